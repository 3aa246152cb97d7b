variable "name" {
  description = "Prefix for every resource; also the value of the fleetbroker-deployment tag."
  type        = string
  default     = "fleetbroker"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,17}$", var.name))
    error_message = "name must be 2-18 lowercase letters, digits or '-', starting with a letter (Key Vault names are short)."
  }
}

variable "location" {
  description = "Azure region of the control plane (the broker launches jobs in any region)."
  type        = string
  default     = "eastus"
}

variable "vm_size" {
  description = "Broker VM size; the control plane needs no GPU."
  type        = string
  default     = "Standard_B2s"
}

variable "admin_username" {
  description = "The broker VM's admin user (SSH key only, no password)."
  type        = string
  default     = "fleet"
}

variable "ssh_public_key" {
  description = "OpenSSH public key of the admin user."
  type        = string
}

variable "vnet_cidr" {
  description = "The broker's virtual network."
  type        = string
  default     = "10.44.0.0/16"
}

variable "api_allowed_cidrs" {
  description = "Who may reach the broker API (port 8080). Keep it narrow."
  type        = list(string)
  default     = []
}

variable "managed_redis" {
  description = "Use Azure Cache for Redis (Premium: a replica, AOF persistence, TLS only) instead of the VM's own redis-server with AOF."
  type        = bool
  default     = false
}

variable "redis_capacity" {
  description = "Azure Cache for Redis Premium size (1 = P1)."
  type        = number
  default     = 1
}

variable "fleetbroker_version" {
  description = "pip requirement installed on the broker VM."
  type        = string
  default     = "fleetbroker[azure]"
}

variable "api_token" {
  description = "Admin bearer token for the broker API, e.g. TF_VAR_api_token=$(openssl rand -hex 32)."
  type        = string
  sensitive   = true
  validation {
    condition     = length(var.api_token) >= 32
    error_message = "api_token must be at least 32 characters; generate one with: openssl rand -hex 32."
  }
}

variable "secret_expiration" {
  description = "When the Key Vault secrets expire (RFC 3339); rotate the token before."
  type        = string
  default     = "2027-12-31T00:00:00Z"
}
