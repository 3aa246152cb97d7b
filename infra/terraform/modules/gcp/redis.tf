# Memorystore for Redis, when managed_redis: STANDARD_HA keeps a replica in another zone with
# automatic failover, so the broker confirms a submission once the replica has it (WAIT 1,
# docs/operations.md); AUTH on, TLS in transit.
resource "google_redis_instance" "state" {
  count                   = var.managed_redis ? 1 : 0
  project                 = var.project
  name                    = "${var.name}-state"
  region                  = var.region
  tier                    = "STANDARD_HA"
  memory_size_gb          = var.redis_memory_gb
  redis_version           = "REDIS_7_2"
  authorized_network      = google_compute_network.broker.id
  auth_enabled            = true
  transit_encryption_mode = "SERVER_AUTHENTICATION"
  labels                  = local.labels
  persistence_config {
    persistence_mode    = "RDB"
    rdb_snapshot_period = "ONE_HOUR"
  }
}
