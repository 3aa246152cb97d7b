# Azure Cache for Redis, when managed_redis: Premium keeps a replica and writes an AOF, TLS 1.2
# only, reached through a private endpoint in the broker's subnet with its public endpoint
# disabled (a Private Link cache can turn that off; a subnet-injected one cannot).
resource "azurerm_redis_cache" "state" {
  count                         = var.managed_redis ? 1 : 0
  name                          = "${var.name}-state"
  resource_group_name           = azurerm_resource_group.broker.name
  location                      = azurerm_resource_group.broker.location
  sku_name                      = "Premium"
  family                        = "P"
  capacity                      = var.redis_capacity
  non_ssl_port_enabled          = false
  minimum_tls_version           = "1.2"
  public_network_access_enabled = false
  tags                          = local.tags

  # the cache writes its AOF with this identity's role on the storage account, not a shared key
  identity {
    type         = "UserAssigned"
    identity_ids = [azurerm_user_assigned_identity.redis[0].id]
  }

  redis_configuration {
    aof_backup_enabled                     = true
    data_persistence_authentication_method = "ManagedIdentity"
    storage_account_subscription_id        = data.azurerm_client_config.current.subscription_id
    aof_storage_connection_string_0 = format("DefaultEndpointsProtocol=https;BlobEndpoint=%s;AccountName=%s",
    azurerm_storage_account.aof[0].primary_blob_endpoint, azurerm_storage_account.aof[0].name)
  }

  depends_on = [azurerm_role_assignment.redis_aof]
}

resource "azurerm_private_endpoint" "redis" {
  count               = var.managed_redis ? 1 : 0
  name                = "${var.name}-redis"
  resource_group_name = azurerm_resource_group.broker.name
  location            = azurerm_resource_group.broker.location
  subnet_id           = azurerm_subnet.broker.id
  tags                = local.tags

  private_service_connection {
    name                           = "${var.name}-redis"
    private_connection_resource_id = azurerm_redis_cache.state[0].id
    subresource_names              = ["redisCache"]
    is_manual_connection           = false
  }

  private_dns_zone_group {
    name                 = "redis"
    private_dns_zone_ids = [azurerm_private_dns_zone.redis[0].id]
  }
}

# The cache's host name resolves, inside the network, to the private endpoint's address.
resource "azurerm_private_dns_zone" "redis" {
  count               = var.managed_redis ? 1 : 0
  name                = "privatelink.redis.cache.windows.net"
  resource_group_name = azurerm_resource_group.broker.name
  tags                = local.tags
}

resource "azurerm_private_dns_zone_virtual_network_link" "redis" {
  count                 = var.managed_redis ? 1 : 0
  name                  = "${var.name}-redis"
  resource_group_name   = azurerm_resource_group.broker.name
  private_dns_zone_name = azurerm_private_dns_zone.redis[0].name
  virtual_network_id    = azurerm_virtual_network.broker.id
  tags                  = local.tags
}

resource "azurerm_user_assigned_identity" "redis" {
  count               = var.managed_redis ? 1 : 0
  name                = "${var.name}-redis"
  resource_group_name = azurerm_resource_group.broker.name
  location            = azurerm_resource_group.broker.location
  tags                = local.tags
}

resource "azurerm_role_assignment" "redis_aof" {
  count                = var.managed_redis ? 1 : 0
  scope                = azurerm_storage_account.aof[0].id
  role_definition_name = "Storage Blob Data Contributor"
  principal_id         = azurerm_user_assigned_identity.redis[0].principal_id
}

# Where Redis writes its append-only file: no shared key, and a firewall that admits only
# trusted Azure services (Azure Cache for Redis is one, with its managed identity).
resource "azurerm_storage_account" "aof" {
  #checkov:skip=CKV_AZURE_59:the cache writes its AOF from the Redis service's network, not from ours, so the public endpoint stays on; network_rules deny all but trusted Azure services, and no shared key is accepted
  #checkov:skip=CKV2_AZURE_33:no private endpoint: the cache writes to the account from the Redis service's network, which a private endpoint in ours would not serve
  #checkov:skip=CKV2_AZURE_1:Microsoft-managed keys encrypt it; a customer-managed key needs a Key Vault key and an identity for the account, left to deployments that require one
  #checkov:skip=CKV_AZURE_206:ZRS survives a zone's loss; the AOF is replayed only by this cache in this region, so a copy in another region has no reader
  #checkov:skip=CKV_AZURE_43:the name is computed, which checkov does not evaluate (md5): var.name (validated to [a-z0-9-]) without '-', 'aof' and 6 hex digits, cut at 24, so 3-24 lowercase letters and digits
  #checkov:skip=CKV_AZURE_33:the account holds the AOF blobs only and no queue, so queue logging would log nothing
  count                           = var.managed_redis ? 1 : 0
  name                            = substr(replace("${var.name}aof${substr(md5(azurerm_resource_group.broker.id), 0, 6)}", "-", ""), 0, 24)
  resource_group_name             = azurerm_resource_group.broker.name
  location                        = azurerm_resource_group.broker.location
  account_tier                    = "Standard"
  account_replication_type        = "ZRS"
  min_tls_version                 = "TLS1_2"
  allow_nested_items_to_be_public = false
  shared_access_key_enabled       = false
  tags                            = local.tags

  network_rules {
    default_action = "Deny"
    bypass         = ["AzureServices"]
  }

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
