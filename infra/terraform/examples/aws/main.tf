# The broker on EC2 with ElastiCache:
#   export TF_VAR_api_token=$(openssl rand -hex 32) TF_VAR_redis_auth_token=$(openssl rand -hex 32)
#   terraform init && terraform apply -var ami_id=ami-...
# (-var managed_redis=false: the host's own redis-server with AOF, no token needed)
variable "region" {
  description = "AWS region of the control plane (the broker launches jobs in any region)."
  type        = string
  default     = "us-east-1"
}

variable "ami_id" {
  description = "AMI for the broker host (Debian 12 or Ubuntu 22.04+ with python3.11)."
  type        = string
}

variable "api_token" {
  description = "Admin bearer token for the broker API (at least 32 characters)."
  type        = string
  sensitive   = true
}

variable "managed_redis" {
  description = "ElastiCache (true) or the host's own redis-server with AOF (false)."
  type        = bool
  default     = true
}

variable "redis_auth_token" {
  description = "ElastiCache AUTH token (16-128 characters), with managed_redis."
  type        = string
  default     = null
  sensitive   = true
}

provider "aws" {
  region = var.region
}

module "fleetbroker" {
  source            = "../../modules/aws"
  ami_id            = var.ami_id
  api_token         = var.api_token
  managed_redis     = var.managed_redis
  redis_auth_token  = var.redis_auth_token
  api_allowed_cidrs = ["203.0.113.0/24"]
}

output "broker_url" {
  description = "FLEET_URL for the fleet CLI."
  value       = module.fleetbroker.broker_url
}

output "broker_instance_id" {
  description = "The broker host's EC2 instance id."
  value       = module.fleetbroker.broker_instance_id
}

output "api_token_parameter" {
  description = "aws ssm get-parameter --with-decryption --name <this>"
  value       = module.fleetbroker.api_token_parameter
}
