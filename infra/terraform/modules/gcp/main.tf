# One broker VM (Compute Engine), its admin token in Secret Manager and, optionally, Memorystore.
locals {
  labels = { "fleetbroker-deployment" = var.name }
  # TLS to Memorystore is verified against its own CA, written to this file at boot
  redis_ca_file = "/etc/fleetbroker/redis-ca.pem"
  redis_url = var.managed_redis ? format("rediss://:%s@%s:%d/0?ssl_ca_certs=%s",
    google_redis_instance.state[0].auth_string, google_redis_instance.state[0].host,
  google_redis_instance.state[0].port, local.redis_ca_file) : ""
}

resource "google_service_account" "broker" {
  project      = var.project
  account_id   = "${var.name}-broker"
  display_name = "FleetBroker control plane"
}

# The broker launches and terminates the VMs of jobs and reads prices and quotas.
resource "google_project_iam_member" "compute" {
  project = var.project
  role    = "roles/compute.instanceAdmin.v1"
  member  = "serviceAccount:${google_service_account.broker.email}"
}

resource "google_secret_manager_secret" "api_token" {
  project   = var.project
  secret_id = "${var.name}-api-token"
  labels    = local.labels
  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_version" "api_token" {
  secret      = google_secret_manager_secret.api_token.id
  secret_data = var.api_token
}

resource "google_secret_manager_secret_version" "redis_url" {
  count       = var.managed_redis ? 1 : 0
  secret      = google_secret_manager_secret.redis_url[0].id
  secret_data = local.redis_url
}

resource "google_secret_manager_secret" "redis_url" {
  count     = var.managed_redis ? 1 : 0
  project   = var.project
  secret_id = "${var.name}-redis-url"
  labels    = local.labels
  replication {
    auto {}
  }
}

# Only the broker's own account may read its secrets.
resource "google_secret_manager_secret_iam_member" "api_token" {
  project   = var.project
  secret_id = google_secret_manager_secret.api_token.secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.broker.email}"
}

resource "google_secret_manager_secret_iam_member" "redis_url" {
  count     = var.managed_redis ? 1 : 0
  project   = var.project
  secret_id = google_secret_manager_secret.redis_url[0].secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.broker.email}"
}

resource "google_compute_instance" "broker" {
  #checkov:skip=CKV_GCP_40:the API must be reachable by api_allowed_cidrs and by the jobs' agents on other clouds; the firewall admits port 8080 from those only
  #checkov:skip=CKV_GCP_38:customer-supplied keys would have to be given at every boot; the disk holds the broker's state, encrypted with Google-managed keys
  project      = var.project
  name         = "${var.name}-broker"
  zone         = var.zone
  machine_type = var.machine_type
  labels       = local.labels
  tags         = ["${var.name}-api"]

  boot_disk {
    initialize_params {
      image = var.image
      size  = 50
    }
  }

  network_interface {
    subnetwork = google_compute_subnetwork.broker.id
    # A public address so that api_allowed_cidrs (and the jobs' agents) reach the API.
    access_config {}
  }

  service_account {
    email  = google_service_account.broker.email
    scopes = ["cloud-platform"]
  }

  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
    # the secrets are read from Secret Manager at boot: none is in the metadata
    startup-script = templatefile("${path.module}/startup.sh.tftpl", {
      requirement   = var.fleetbroker_version
      token_secret  = google_secret_manager_secret.api_token.secret_id
      redis_secret  = var.managed_redis ? google_secret_manager_secret.redis_url[0].secret_id : ""
      redis_ca      = var.managed_redis ? google_redis_instance.state[0].server_ca_certs[0].cert : ""
      redis_ca_file = local.redis_ca_file
      project       = var.project
    })
  }

  depends_on = [google_secret_manager_secret_version.api_token]
}
