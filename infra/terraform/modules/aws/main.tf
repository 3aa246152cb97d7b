# FleetBroker control plane on AWS: one broker host (scheduler, actuator, API) and its Redis.
locals {
  tags = {
    "fleetbroker:deployment" = var.name
  }
}

# The region comes from the caller's provider configuration; the host's aws CLI needs it to reach SSM.
data "aws_region" "current" {}

# The admin token lives in SSM (encrypted); the host reads it at boot, it never enters user data.
resource "aws_ssm_parameter" "api_token" {
  #checkov:skip=CKV_AWS_337:encrypted under the account's AWS-managed key (alias/aws/ssm); a customer-managed key adds a key policy to keep, left to deployments that require one
  name        = "/${var.name}/api-token"
  description = "FleetBroker admin API token"
  type        = "SecureString"
  value       = var.api_token
  tags        = local.tags
}

resource "aws_instance" "broker" {
  #checkov:skip=CKV_AWS_126:no detailed (1-minute) EC2 monitoring, billed per instance: the broker's own /metrics covers the control plane
  ami                    = var.ami_id
  instance_type          = var.instance_type
  subnet_id              = aws_subnet.public[0].id
  vpc_security_group_ids = [aws_security_group.broker.id]
  iam_instance_profile   = aws_iam_instance_profile.broker.name
  ebs_optimized          = true
  user_data = templatefile("${path.module}/user_data.sh.tftpl", {
    region      = data.aws_region.current.name
    requirement = var.fleetbroker_version
    redis_param = var.managed_redis ? aws_ssm_parameter.redis_url[0].name : ""
    token_param = aws_ssm_parameter.api_token.name
  })
  metadata_options {
    http_tokens = "required" # IMDSv2 only
  }
  root_block_device {
    encrypted   = true
    volume_size = 30
  }
  tags = merge(local.tags, { Name = "${var.name}-broker" })
}
