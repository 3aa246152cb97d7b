# One broker VM, its secrets in Key Vault (read at boot with the VM's managed identity) and,
# optionally, Azure Cache for Redis.
data "azurerm_client_config" "current" {}

locals {
  tags = { "fleetbroker-deployment" = var.name }
}

resource "azurerm_resource_group" "broker" {
  name     = "${var.name}-rg"
  location = var.location
  tags     = local.tags
}

resource "azurerm_user_assigned_identity" "broker" {
  name                = "${var.name}-broker"
  resource_group_name = azurerm_resource_group.broker.name
  location            = azurerm_resource_group.broker.location
  tags                = local.tags
}

resource "azurerm_key_vault" "broker" {
  #checkov:skip=CKV2_AZURE_32:no private endpoint: its network rules admit the broker's subnet (service endpoint) and the deployer's api_allowed_cidrs only
  name                       = "${var.name}-kv"
  resource_group_name        = azurerm_resource_group.broker.name
  location                   = azurerm_resource_group.broker.location
  tenant_id                  = data.azurerm_client_config.current.tenant_id
  sku_name                   = "standard"
  rbac_authorization_enabled = true
  purge_protection_enabled   = true
  soft_delete_retention_days = 30
  tags                       = local.tags
  network_acls {
    default_action = "Deny"
    bypass         = "AzureServices"
    # the deployer writes the secrets; the broker reads them from its subnet
    ip_rules                   = var.api_allowed_cidrs
    virtual_network_subnet_ids = [azurerm_subnet.broker.id]
  }
}

# The deployer (whoever runs terraform) writes the secrets; the broker's identity reads them.
resource "azurerm_role_assignment" "deployer" {
  scope                = azurerm_key_vault.broker.id
  role_definition_name = "Key Vault Secrets Officer"
  principal_id         = data.azurerm_client_config.current.object_id
}

resource "azurerm_role_assignment" "broker_secrets" {
  scope                = azurerm_key_vault.broker.id
  role_definition_name = "Key Vault Secrets User"
  principal_id         = azurerm_user_assigned_identity.broker.principal_id
}

resource "azurerm_key_vault_secret" "api_token" {
  name            = "api-token"
  value           = var.api_token
  key_vault_id    = azurerm_key_vault.broker.id
  content_type    = "text/plain"
  expiration_date = var.secret_expiration
  depends_on      = [azurerm_role_assignment.deployer]
}

resource "azurerm_key_vault_secret" "redis_url" {
  count = var.managed_redis ? 1 : 0
  name  = "redis-url"
  value = format("rediss://:%s@%s:%d/0", azurerm_redis_cache.state[0].primary_access_key,
  azurerm_redis_cache.state[0].hostname, azurerm_redis_cache.state[0].ssl_port)
  key_vault_id    = azurerm_key_vault.broker.id
  content_type    = "text/plain"
  expiration_date = var.secret_expiration
  depends_on      = [azurerm_role_assignment.deployer]
}

resource "azurerm_linux_virtual_machine" "broker" {
  name                            = "${var.name}-broker"
  resource_group_name             = azurerm_resource_group.broker.name
  location                        = azurerm_resource_group.broker.location
  size                            = var.vm_size
  admin_username                  = var.admin_username
  disable_password_authentication = true
  network_interface_ids           = [azurerm_network_interface.broker.id]
  encryption_at_host_enabled      = true
  allow_extension_operations      = false
  tags                            = local.tags
  # the secrets are read from Key Vault at boot: none is in the custom data
  custom_data = base64encode(templatefile("${path.module}/cloud_init.sh.tftpl", {
    requirement  = var.fleetbroker_version
    vault        = azurerm_key_vault.broker.name
    client_id    = azurerm_user_assigned_identity.broker.client_id
    redis_secret = var.managed_redis ? azurerm_key_vault_secret.redis_url[0].name : ""
  }))

  admin_ssh_key {
    username   = var.admin_username
    public_key = var.ssh_public_key
  }

  identity {
    type         = "UserAssigned"
    identity_ids = [azurerm_user_assigned_identity.broker.id]
  }

  os_disk {
    caching              = "ReadWrite"
    storage_account_type = "Premium_LRS"
    disk_size_gb         = 64
  }

  source_image_reference {
    publisher = "Debian"
    offer     = "debian-12"
    sku       = "12-gen2"
    version   = "latest"
  }

  depends_on = [azurerm_role_assignment.broker_secrets]
}
