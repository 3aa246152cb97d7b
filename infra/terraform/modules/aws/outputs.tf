output "broker_url" {
  description = "Point the CLI here: FLEET_URL=<this> fleet jobs"
  value       = "http://${aws_instance.broker.public_dns}:8080"
}

output "broker_instance_id" {
  description = "The broker host's EC2 instance id."
  value       = aws_instance.broker.id
}

output "api_token_parameter" {
  description = "aws ssm get-parameter --with-decryption --name <this>"
  value       = aws_ssm_parameter.api_token.name
}

output "redis_host" {
  description = "ElastiCache's primary endpoint when managed_redis, else empty (the host's own redis-server); the URL with its AUTH token is in SSM (/<name>/redis-url)."
  value       = var.managed_redis ? aws_elasticache_replication_group.state[0].primary_endpoint_address : ""
}
