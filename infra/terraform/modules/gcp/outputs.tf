output "broker_url" {
  description = "The broker API's URL (FLEET_URL for the fleet CLI)."
  value       = "http://${google_compute_instance.broker.network_interface[0].access_config[0].nat_ip}:8080"
}

output "broker_instance" {
  description = "The broker VM's name."
  value       = google_compute_instance.broker.name
}

output "api_token_secret" {
  description = "The Secret Manager secret that holds the admin token."
  value       = google_secret_manager_secret.api_token.secret_id
}

output "redis_host" {
  description = "Memorystore's address when managed_redis, else empty (the VM's own redis-server)."
  value       = var.managed_redis ? google_redis_instance.state[0].host : ""
}
