# Azure Cache for Redis, when managed_redis: Premium keeps a replica and writes an AOF, TLS 1.2
# only, injected into a subnet of the broker's network (reached from there only).
resource "azurerm_redis_cache" "state" {
  count                = var.managed_redis ? 1 : 0
  name                 = "${var.name}-state"
  resource_group_name  = azurerm_resource_group.broker.name
  location             = azurerm_resource_group.broker.location
  sku_name             = "Premium"
  family               = "P"
  capacity             = var.redis_capacity
  non_ssl_port_enabled = false
  minimum_tls_version  = "1.2"
  subnet_id            = azurerm_subnet.redis[0].id
  tags                 = local.tags

  redis_configuration {
    aof_backup_enabled              = true
    aof_storage_connection_string_0 = azurerm_storage_account.aof[0].primary_blob_connection_string
  }
}

resource "azurerm_subnet" "redis" {
  count                = var.managed_redis ? 1 : 0
  name                 = "${var.name}-redis"
  resource_group_name  = azurerm_resource_group.broker.name
  virtual_network_name = azurerm_virtual_network.broker.name
  address_prefixes     = [cidrsubnet(var.vnet_cidr, 8, 2)]
}

resource "azurerm_subnet_network_security_group_association" "redis" {
  count                     = var.managed_redis ? 1 : 0
  subnet_id                 = azurerm_subnet.redis[0].id
  network_security_group_id = azurerm_network_security_group.broker.id
}

# Where Redis writes its append-only file.
resource "azurerm_storage_account" "aof" {
  #checkov:skip=CKV2_AZURE_40:Azure Cache for Redis writes its AOF with the account's connection string (shared key); nothing else uses the account
  #checkov:skip=CKV2_AZURE_33:no private endpoint: only the Redis service writes to it, through Azure's network
  #checkov:skip=CKV2_AZURE_1:Microsoft-managed keys encrypt it; a customer-managed key needs a Key Vault key and an identity for the account, left to deployments that require one
  count                           = var.managed_redis ? 1 : 0
  name                            = substr(replace("${var.name}aof${substr(md5(azurerm_resource_group.broker.id), 0, 6)}", "-", ""), 0, 24)
  resource_group_name             = azurerm_resource_group.broker.name
  location                        = azurerm_resource_group.broker.location
  account_tier                    = "Standard"
  account_replication_type        = "ZRS"
  min_tls_version                 = "TLS1_2"
  allow_nested_items_to_be_public = false
  shared_access_key_enabled       = true
  tags                            = local.tags

  blob_properties {
    delete_retention_policy {
      days = 7
    }
    container_delete_retention_policy {
      days = 7
    }
  }

  sas_policy {
    expiration_period = "01.00:00:00"
  }
}
