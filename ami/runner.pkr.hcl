# The byoc-runner AMI: a stock Debian 12 image, the byoc-runner package (verified
# against the release's minisign-signed SHA256SUMS), terraform, helm and kubectl at
# pinned versions verified against pinned SHA-256 checksums, and host hardening. The
# install stack's user-data then only configures (it finds the package in
# /opt/byoc-runner/release and re-verifies it).
#
#   packer init ami/runner.pkr.hcl
#   packer build -var release_dir=dist -var "release_pubkey=$(sed -n 2p release.pub)" ami/runner.pkr.hcl
#
# Every download is checked against a checksum pinned in this file before it is
# installed; a checksum variable that is not well-formed stops the build.

packer {
  required_plugins {
    amazon = {
      source  = "github.com/hashicorp/amazon"
      version = "= 1.3.3"
    }
  }
}

variable "region" {
  type    = string
  default = "eu-west-1"
}

variable "instance_type" {
  type    = string
  default = "t3.small"
}

variable "release_dir" {
  type        = string
  description = "Directory with byoc-runner_<version>_amd64.deb, SHA256SUMS and SHA256SUMS.minisig (./scripts/package)."
}

variable "release_pubkey" {
  type        = string
  description = "The minisign public key (base64 line) that signed SHA256SUMS."
}

# Tool pins. Bumping one: `ami/pin-tools` (with internet access) prints the versions and
# checksums from each project's published checksum files; review and commit them here.
# Provenance of the values below: ami/README.md.
variable "terraform_version" {
  type    = string
  default = "1.9.8"
}

variable "terraform_sha256" {
  type        = string
  description = "SHA-256 of terraform_<version>_linux_amd64.zip, from HashiCorp's terraform_<version>_SHA256SUMS."
  default     = "186e0145f5e5f2eb97cbd785bc78f21bae4ef15119349f6ad4fa535b83b10df8"
  validation {
    condition     = can(regex("^[0-9a-f]{64}$", var.terraform_sha256))
    error_message = "terraform_sha256 must be 64 hex digits (ami/pin-tools)."
  }
}

variable "helm_version" {
  type    = string
  default = "3.19.0"
}

variable "helm_sha256" {
  type        = string
  description = "SHA-256 of helm-v<version>-linux-amd64.tar.gz, from get.helm.sh's .sha256sum file."
  default     = "a7f81ce08007091b86d8bd696eb4d86b8d0f2e1b9f6c714be62f82f96a594496"
  validation {
    condition     = can(regex("^[0-9a-f]{64}$", var.helm_sha256))
    error_message = "helm_sha256 must be 64 hex digits (ami/pin-tools)."
  }
}

variable "kubectl_version" {
  type    = string
  default = "1.34.7"
}

variable "kubectl_sha512" {
  type        = string
  description = "SHA-512 of kubernetes-client-linux-amd64.tar.gz v<version>, as Kubernetes' CHANGELOG publishes it."
  default     = "a9de2b5a5b71a5d52b712940a268f643fb57edc25889f4e7fd52b04aadc56c2ae06c2e002c3f40cbb10dc1c4e459dce84f62879f12517c27ec53b4b71b2f871d"
  validation {
    condition     = can(regex("^[0-9a-f]{128}$", var.kubectl_sha512))
    error_message = "kubectl_sha512 must be 128 hex digits (ami/pin-tools)."
  }
}

source "amazon-ebs" "runner" {
  region        = var.region
  instance_type = var.instance_type
  ami_name      = "byoc-runner-{{timestamp}}"
  ssh_username  = "admin"
  source_ami_filter {
    filters = {
      name                = "debian-12-amd64-*"
      architecture        = "x86_64"
      virtualization-type = "hvm"
      root-device-type    = "ebs"
    }
    owners      = ["136693071363"] # Debian's official AWS account
    most_recent = true
  }
  # The image requires IMDSv2, and so does the build instance.
  imds_support = "v2.0"
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }
  encrypt_boot = true
  launch_block_device_mappings {
    device_name           = "/dev/xvda"
    volume_size           = 30
    volume_type           = "gp3"
    encrypted             = true
    delete_on_termination = true
  }
  tags = {
    Name    = "byoc-runner"
    Builder = "packer"
  }
}

build {
  sources = ["source.amazon-ebs.runner"]

  provisioner "file" {
    source      = "${var.release_dir}/"
    destination = "/tmp/byoc-release"
  }

  # The package: signature first, then checksum, then install. The release stays in
  # /opt/byoc-runner/release for the user-data to find (and verify again).
  provisioner "shell" {
    environment_vars = ["RELEASE_PUBKEY=${var.release_pubkey}", "DEBIAN_FRONTEND=noninteractive"]
    inline = [
      "set -eu",
      "sudo apt-get update -qq",
      "sudo apt-get install -y -qq --no-install-recommends minisign awscli curl unzip ca-certificates chrony unattended-upgrades",
      "printf 'untrusted comment: byoc-runner release key\\n%s\\n' \"$RELEASE_PUBKEY\" > /tmp/release.pub",
      "minisign -V -q -p /tmp/release.pub -m /tmp/byoc-release/SHA256SUMS",
      "cd /tmp/byoc-release && sha256sum -c --strict SHA256SUMS",
      "sudo install -d -m 0755 /opt/byoc-runner/release",
      "sudo cp /tmp/byoc-release/* /opt/byoc-runner/release/",
      "sudo dpkg -i /opt/byoc-runner/release/byoc-runner_*.deb",
    ]
  }

  # Tools the executors run, at pinned versions, each verified before it is installed.
  provisioner "shell" {
    environment_vars = [
      "TF_VERSION=${var.terraform_version}", "TF_SHA256=${var.terraform_sha256}",
      "HELM_VERSION=${var.helm_version}", "HELM_SHA256=${var.helm_sha256}",
      "KUBECTL_VERSION=${var.kubectl_version}", "KUBECTL_SHA512=${var.kubectl_sha512}",
    ]
    inline = [
      "set -eu",
      "cd \"$(mktemp -d)\"",
      "curl -fsSL --proto =https -o terraform.zip https://releases.hashicorp.com/terraform/$TF_VERSION/terraform_$${TF_VERSION}_linux_amd64.zip",
      "echo \"$TF_SHA256  terraform.zip\" | sha256sum -c --strict",
      "unzip -q terraform.zip terraform && sudo install -m 0755 terraform /usr/local/bin/terraform",
      "curl -fsSL --proto =https -o helm.tgz https://get.helm.sh/helm-v$HELM_VERSION-linux-amd64.tar.gz",
      "echo \"$HELM_SHA256  helm.tgz\" | sha256sum -c --strict",
      "tar -xzf helm.tgz linux-amd64/helm && sudo install -m 0755 linux-amd64/helm /usr/local/bin/helm",
      "curl -fsSL --proto =https -o kubernetes-client.tgz https://dl.k8s.io/v$KUBECTL_VERSION/kubernetes-client-linux-amd64.tar.gz",
      "echo \"$KUBECTL_SHA512  kubernetes-client.tgz\" | sha512sum -c --strict",
      "tar -xzf kubernetes-client.tgz kubernetes/client/bin/kubectl && sudo install -m 0755 kubernetes/client/bin/kubectl /usr/local/bin/kubectl",
      "terraform version && helm version --short && kubectl version --client",
    ]
  }

  # Host hardening: what the runner needs, nothing it does not.
  provisioner "shell" {
    inline = [
      "set -eu",
      # The job sandbox needs unprivileged user namespaces; the rest narrows the kernel.
      "printf '%s\\n' 'user.max_user_namespaces = 15000' 'kernel.kptr_restrict = 2' 'kernel.dmesg_restrict = 1' 'kernel.unprivileged_bpf_disabled = 1' 'net.ipv4.conf.all.accept_redirects = 0' 'net.ipv4.conf.all.send_redirects = 0' 'fs.protected_symlinks = 1' 'fs.protected_hardlinks = 1' | sudo tee /etc/sysctl.d/60-byoc-runner.conf >/dev/null",
      # Nobody logs in: SSH is off in the image (break-glass is an IAM role, not a shell).
      # Disabled, not purged: this build still talks to the instance over SSH.
      "sudo systemctl disable ssh.service ssh.socket || true",
      "sudo systemctl mask ssh.service",
      "sudo systemctl enable chrony unattended-upgrades",
      "sudo systemctl disable byoc-runner || true", # the user-data configures, then starts it
      "sudo apt-get clean",
      "sudo rm -rf /tmp/byoc-release /var/lib/apt/lists/* /root/.ssh /home/admin/.ssh",
    ]
  }
}
