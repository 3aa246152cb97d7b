variable "name" {
  description = "Prefix for every resource; also the value of the fleetbroker:deployment tag."
  type        = string
  default     = "fleetbroker"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 lowercase letters, digits or '-', starting with a letter."
  }
}

variable "ami_id" {
  description = "AMI for the broker host (Debian 12 or Ubuntu 22.04+ with python3.11)."
  type        = string
}

variable "instance_type" {
  description = "Broker host size; the control plane needs no GPU."
  type        = string
  default     = "t3.medium"
}

variable "vpc_cidr" {
  description = "The broker's VPC; its two subnets are the first two /24s."
  type        = string
  default     = "10.42.0.0/16"
}

variable "api_allowed_cidrs" {
  description = "Who may reach the broker API (port 8080). Keep it narrow."
  type        = list(string)
  default     = []
}

variable "managed_redis" {
  description = "Use ElastiCache (Multi-AZ, encrypted, min-replicas-to-write) instead of the embedded redis-server with AOF."
  type        = bool
  default     = false
}

variable "redis_node_type" {
  description = "ElastiCache node type of each of the two nodes, when managed_redis."
  type        = string
  default     = "cache.t4g.small"
}

variable "redis_auth_token" {
  description = "ElastiCache AUTH token, required with managed_redis, e.g. TF_VAR_redis_auth_token=$(openssl rand -hex 32)."
  type        = string
  default     = null
  sensitive   = true
  validation {
    # ElastiCache takes 16-128 printable characters; URL-safe ones keep the Redis URL unescaped
    condition     = var.redis_auth_token == null || can(regex("^[A-Za-z0-9_.~-]{16,128}$", var.redis_auth_token))
    error_message = "redis_auth_token must be 16-128 letters, digits or _.~-; generate one with: openssl rand -hex 32."
  }
}

variable "fleetbroker_version" {
  description = "pip requirement installed on the broker host."
  type        = string
  default     = "fleetbroker[broker,aws]"
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
