# The example component the demo publishes as an OCI artifact, syncs into the install's
# registry and applies by digest with the real terraform. terraform_data needs no
# provider plugin, so it runs offline; a real component would declare aws_* resources.
variable "environment" {
  type    = string
  default = "demo"
}

resource "terraform_data" "vpc" {
  input = "${var.environment}-vpc"
}

resource "terraform_data" "subnets" {
  count = 2
  input = "${terraform_data.vpc.output}-subnet-${count.index}"
}

output "vpc" {
  value = terraform_data.vpc.output
}
