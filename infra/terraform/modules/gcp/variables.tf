variable "name" {
  description = "Prefix for every resource; also the value of the fleetbroker-deployment label."
  type        = string
  default     = "fleetbroker"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 lowercase letters, digits or '-', starting with a letter."
  }
}

variable "project" {
  description = "GCP project of the control plane (the broker launches jobs in any project it may)."
  type        = string
}

variable "region" {
  description = "Region of the control plane."
  type        = string
  default     = "us-central1"
}

variable "zone" {
  description = "Zone of the broker VM, in region."
  type        = string
  default     = "us-central1-a"
}

variable "machine_type" {
  description = "Broker VM size; the control plane needs no GPU."
  type        = string
  default     = "e2-standard-2"
}

variable "image" {
  description = "Boot image of the broker VM (Debian 12 has python3.11 and gcloud)."
  type        = string
  default     = "debian-cloud/debian-12"
}

variable "subnet_cidr" {
  description = "The broker's subnet."
  type        = string
  default     = "10.43.0.0/24"
}

variable "api_allowed_cidrs" {
  description = "Who may reach the broker API (port 8080). Keep it narrow."
  type        = list(string)
  default     = []
}

variable "managed_redis" {
  description = "Use Memorystore for Redis (STANDARD_HA: a replica in another zone, AUTH, TLS) instead of the VM's own redis-server with AOF."
  type        = bool
  default     = false
}

variable "redis_memory_gb" {
  description = "Memorystore capacity."
  type        = number
  default     = 1
}

variable "fleetbroker_version" {
  description = "pip requirement installed on the broker VM."
  type        = string
  default     = "fleetbroker[gcp]"
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
