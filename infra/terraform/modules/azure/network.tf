resource "azurerm_virtual_network" "broker" {
  name                = "${var.name}-vnet"
  resource_group_name = azurerm_resource_group.broker.name
  location            = azurerm_resource_group.broker.location
  address_space       = [var.vnet_cidr]
  tags                = local.tags
}

resource "azurerm_subnet" "broker" {
  name                 = "${var.name}-subnet"
  resource_group_name  = azurerm_resource_group.broker.name
  virtual_network_name = azurerm_virtual_network.broker.name
  address_prefixes     = [cidrsubnet(var.vnet_cidr, 8, 1)]
  service_endpoints    = ["Microsoft.KeyVault"]
}

# Port 8080 only from api_allowed_cidrs; nothing else comes in (no SSH rule: add one to reach
# the VM, or use Azure Bastion).
resource "azurerm_network_security_group" "broker" {
  name                = "${var.name}-nsg"
  resource_group_name = azurerm_resource_group.broker.name
  location            = azurerm_resource_group.broker.location
  tags                = local.tags

  dynamic "security_rule" {
    for_each = length(var.api_allowed_cidrs) > 0 ? [1] : []
    content {
      name                       = "api"
      priority                   = 100
      direction                  = "Inbound"
      access                     = "Allow"
      protocol                   = "Tcp"
      source_port_range          = "*"
      destination_port_range     = "8080"
      source_address_prefixes    = var.api_allowed_cidrs
      destination_address_prefix = "*"
    }
  }
}

resource "azurerm_subnet_network_security_group_association" "broker" {
  subnet_id                 = azurerm_subnet.broker.id
  network_security_group_id = azurerm_network_security_group.broker.id
}

# A public address so that api_allowed_cidrs (and the jobs' agents) reach the API.
resource "azurerm_public_ip" "broker" {
  name                = "${var.name}-ip"
  resource_group_name = azurerm_resource_group.broker.name
  location            = azurerm_resource_group.broker.location
  allocation_method   = "Static"
  sku                 = "Standard"
  tags                = local.tags
}

resource "azurerm_network_interface" "broker" {
  #checkov:skip=CKV_AZURE_119:the API must be reachable by api_allowed_cidrs and by the jobs' agents on other clouds; the security group admits port 8080 from those only
  name                = "${var.name}-nic"
  resource_group_name = azurerm_resource_group.broker.name
  location            = azurerm_resource_group.broker.location
  tags                = local.tags

  ip_configuration {
    name                          = "primary"
    subnet_id                     = azurerm_subnet.broker.id
    private_ip_address_allocation = "Dynamic"
    public_ip_address_id          = azurerm_public_ip.broker.id
  }
}
