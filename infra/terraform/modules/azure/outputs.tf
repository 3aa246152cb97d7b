output "broker_url" {
  description = "The broker API's URL (FLEET_URL for the fleet CLI)."
  value       = "http://${azurerm_public_ip.broker.ip_address}:8080"
}

output "broker_vm_id" {
  description = "The broker VM's resource id."
  value       = azurerm_linux_virtual_machine.broker.id
}

output "key_vault" {
  description = "The Key Vault that holds the admin token (secret api-token)."
  value       = azurerm_key_vault.broker.name
}

output "redis_host" {
  description = "Azure Cache for Redis' host name when managed_redis, else empty (the VM's own redis-server)."
  value       = var.managed_redis ? azurerm_redis_cache.state[0].hostname : ""
}
