# Stand-in for SkyPilot repository root setup.py (12-file-mounts.yaml mounts ./setup.py).
