# Optional managed Redis: Multi-AZ with automatic failover, encrypted, and writes refused unless
# a replica has them (min-replicas-to-write), so a failover loses no acknowledged submission.
# It asks for an AUTH token over TLS, so a host in the VPC other than the broker's cannot read
# the queue even if a security group is widened later.
resource "aws_elasticache_subnet_group" "state" {
  count      = var.managed_redis ? 1 : 0
  name       = "${var.name}-state"
  subnet_ids = aws_subnet.public[*].id
}

resource "aws_elasticache_parameter_group" "state" {
  count  = var.managed_redis ? 1 : 0
  name   = "${var.name}-state"
  family = "redis7"
  parameter {
    name  = "appendonly"
    value = "yes"
  }
  parameter {
    name  = "min-replicas-to-write"
    value = "1"
  }
  parameter {
    name  = "min-replicas-max-lag"
    value = "10"
  }
}

resource "aws_security_group" "redis" {
  count       = var.managed_redis ? 1 : 0
  name        = "${var.name}-redis"
  description = "FleetBroker state: only the broker host"
  vpc_id      = aws_vpc.this.id
  tags        = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "redis_from_broker" {
  count                        = var.managed_redis ? 1 : 0
  security_group_id            = aws_security_group.redis[0].id
  referenced_security_group_id = aws_security_group.broker.id
  from_port                    = 6379
  to_port                      = 6379
  ip_protocol                  = "tcp"
  description                  = "Redis from the broker host"
}

# The state and the Redis URL (it holds the AUTH token) are encrypted under a key of this
# deployment's own: its key policy, not every principal that may use the account's AWS-managed
# key, decides who decrypts them.
resource "aws_kms_key" "state" {
  count               = var.managed_redis ? 1 : 0
  description         = "FleetBroker ${var.name}: ElastiCache state and the Redis URL"
  enable_key_rotation = true
  # the account's IAM policies decide who uses the key (the broker role gets Decrypt, iam.tf)
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "AccountIAM"
      Effect    = "Allow"
      Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
      Action    = "kms:*"
      Resource  = "*"
    }]
  })
  tags = local.tags
}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

resource "aws_elasticache_replication_group" "state" {
  count                      = var.managed_redis ? 1 : 0
  replication_group_id       = "${var.name}-state"
  description                = "FleetBroker queue and job state"
  engine                     = "redis"
  node_type                  = var.redis_node_type
  num_cache_clusters         = 2
  automatic_failover_enabled = true
  multi_az_enabled           = true
  at_rest_encryption_enabled = true
  transit_encryption_enabled = true
  kms_key_id                 = aws_kms_key.state[0].arn
  auth_token                 = var.redis_auth_token
  parameter_group_name       = aws_elasticache_parameter_group.state[0].name
  subnet_group_name          = aws_elasticache_subnet_group.state[0].name
  security_group_ids         = [aws_security_group.redis[0].id]
  tags                       = local.tags
  lifecycle {
    precondition {
      condition     = var.redis_auth_token != null
      error_message = "managed_redis needs redis_auth_token; generate one with: openssl rand -hex 32."
    }
  }
}

# The host reads the URL (with the AUTH token) from here at boot: it never enters user data.
resource "aws_ssm_parameter" "redis_url" {
  count       = var.managed_redis ? 1 : 0
  name        = "/${var.name}/redis-url"
  description = "FleetBroker Redis URL, with its AUTH token"
  type        = "SecureString"
  key_id      = aws_kms_key.state[0].arn
  value       = "rediss://:${var.redis_auth_token}@${aws_elasticache_replication_group.state[0].primary_endpoint_address}:6379/0"
  tags        = local.tags
}
