# The broker on Compute Engine with Memorystore:
#   export TF_VAR_api_token=$(openssl rand -hex 32)
#   terraform init && terraform apply -var project=my-project
variable "project" {
  description = "GCP project to deploy into."
  type        = string
}

variable "api_token" {
  description = "Admin bearer token for the broker API (at least 32 characters)."
  type        = string
  sensitive   = true
}

provider "google" {
  project = var.project
  region  = "us-central1"
}

module "fleetbroker" {
  source            = "../../modules/gcp"
  project           = var.project
  api_token         = var.api_token
  managed_redis     = true
  api_allowed_cidrs = ["203.0.113.0/24"]
}

output "broker_url" {
  description = "FLEET_URL for the fleet CLI."
  value       = module.fleetbroker.broker_url
}
