# The broker on an Azure VM with Azure Cache for Redis:
#   export TF_VAR_api_token=$(openssl rand -hex 32)
#   terraform init && terraform apply -var "ssh_public_key=$(cat ~/.ssh/id_ed25519.pub)"
variable "ssh_public_key" {
  description = "OpenSSH public key of the broker VM's admin user."
  type        = string
}

variable "api_token" {
  description = "Admin bearer token for the broker API (at least 32 characters)."
  type        = string
  sensitive   = true
}

provider "azurerm" {
  features {}
  # the AOF storage account takes no shared key, so the provider reaches it with Entra ID
  storage_use_azuread = true
}

module "fleetbroker" {
  source            = "../../modules/azure"
  ssh_public_key    = var.ssh_public_key
  api_token         = var.api_token
  managed_redis     = true
  api_allowed_cidrs = ["203.0.113.0/24"]
}

output "broker_url" {
  description = "FLEET_URL for the fleet CLI."
  value       = module.fleetbroker.broker_url
}
