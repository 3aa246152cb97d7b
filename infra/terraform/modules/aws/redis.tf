# Optional managed Redis: Multi-AZ with automatic failover, encrypted, and writes refused unless
# a replica has them (min-replicas-to-write), so a failover loses no acknowledged submission.
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
}

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
  parameter_group_name       = aws_elasticache_parameter_group.state[0].name
  subnet_group_name          = aws_elasticache_subnet_group.state[0].name
  security_group_ids         = [aws_security_group.redis[0].id]
  tags                       = local.tags
}
