resource "google_compute_network" "broker" {
  project                 = var.project
  name                    = "${var.name}-net"
  auto_create_subnetworks = false
}

resource "google_compute_subnetwork" "broker" {
  project                  = var.project
  name                     = "${var.name}-subnet"
  region                   = var.region
  network                  = google_compute_network.broker.id
  ip_cidr_range            = var.subnet_cidr
  private_ip_google_access = true
  log_config {
    aggregation_interval = "INTERVAL_10_MIN"
    flow_sampling        = 0.5
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# Port 8080 only from api_allowed_cidrs; nothing else comes in (no SSH: use IAP or OS Login).
resource "google_compute_firewall" "api" {
  count         = length(var.api_allowed_cidrs) > 0 ? 1 : 0
  project       = var.project
  name          = "${var.name}-api"
  network       = google_compute_network.broker.id
  direction     = "INGRESS"
  source_ranges = var.api_allowed_cidrs
  target_tags   = ["${var.name}-api"]
  allow {
    protocol = "tcp"
    ports    = ["8080"]
  }
}
