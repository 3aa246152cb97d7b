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

output "redis_url" {
  description = "Empty when the broker host runs its own redis-server with AOF."
  value       = local.redis_url
}
