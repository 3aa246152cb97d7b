# One VPC with two public subnets (two AZs, so ElastiCache can fail over).
data "aws_availability_zones" "available" {
  #checkov:skip=CKV_AWS_394:only the first two zones' names are used; a zone AWS adds later does not change them
  state = "available"
}

resource "aws_vpc" "this" {
  #checkov:skip=CKV2_AWS_11:no flow logs by default (a log group, a role and a cost per GB); add aws_flow_log where the account's policy asks for them
  cidr_block           = var.vpc_cidr
  enable_dns_hostnames = true
  tags                 = local.tags
}

# The VPC's default security group admits nothing (nothing uses it).
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id
  tags   = local.tags
}

resource "aws_subnet" "public" {
  #checkov:skip=CKV_AWS_130:the broker host needs a public address for api_allowed_cidrs and the jobs' agents on other clouds; its security group admits port 8080 from those only
  count                   = 2
  vpc_id                  = aws_vpc.this.id
  cidr_block              = cidrsubnet(var.vpc_cidr, 8, count.index)
  availability_zone       = data.aws_availability_zones.available.names[count.index]
  map_public_ip_on_launch = true
  tags                    = local.tags
}

resource "aws_internet_gateway" "this" {
  vpc_id = aws_vpc.this.id
  tags   = local.tags
}

resource "aws_route_table" "public" {
  vpc_id = aws_vpc.this.id
  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this.id
  }
  tags = local.tags
}

resource "aws_route_table_association" "public" {
  count          = 2
  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public.id
}

resource "aws_security_group" "broker" {
  name        = "${var.name}-broker"
  description = "FleetBroker API"
  vpc_id      = aws_vpc.this.id
  tags        = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "api" {
  for_each          = toset(var.api_allowed_cidrs)
  security_group_id = aws_security_group.broker.id
  cidr_ipv4         = each.value
  from_port         = 8080
  to_port           = 8080
  ip_protocol       = "tcp"
  description       = "broker API"
}

resource "aws_vpc_security_group_egress_rule" "all" {
  security_group_id = aws_security_group.broker.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "-1"
  description       = "cloud APIs and package registries"
}
