# The broker launches and terminates only instances tagged with its id (tag fleet-broker = name).
data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "broker" {
  statement {
    sid = "Describe"
    actions = [
      "ec2:DescribeInstances", "ec2:DescribeInstanceTypes", "ec2:DescribeInstanceTypeOfferings",
      "ec2:DescribeSpotPriceHistory", "ec2:DescribeImages", "ec2:DescribeSubnets",
      "servicequotas:GetServiceQuota",
    ]
    resources = ["*"]
  }
  statement {
    sid       = "LaunchTagged"
    actions   = ["ec2:RunInstances", "ec2:CreateTags"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/fleet-broker"
      values   = [var.name]
    }
  }
  statement {
    sid       = "TerminateOwn"
    actions   = ["ec2:TerminateInstances"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/fleet-broker"
      values   = [var.name]
    }
  }
  statement {
    sid       = "ReadSecrets"
    actions   = ["ssm:GetParameter"]
    resources = concat([aws_ssm_parameter.api_token.arn], aws_ssm_parameter.redis_url[*].arn)
  }
  # the Redis URL's parameter is encrypted under the deployment's own key (redis.tf)
  dynamic "statement" {
    for_each = aws_kms_key.state[*].arn
    content {
      sid       = "DecryptRedisUrl"
      actions   = ["kms:Decrypt"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role" "broker" {
  name               = "${var.name}-broker"
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy" "broker" {
  name   = "${var.name}-broker"
  role   = aws_iam_role.broker.id
  policy = data.aws_iam_policy_document.broker.json
}

resource "aws_iam_instance_profile" "broker" {
  name = "${var.name}-broker"
  role = aws_iam_role.broker.name
}
