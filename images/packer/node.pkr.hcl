# hypercli node image for AWS (amazon-ebs), GCP (googlecompute) and Azure (azure-arm).
# One build, three sources, one set of provisioning scripts (scripts/). `hyper image build`
# runs it with -only=<source> and the variables below; see README.md here.

variable "hyper_version" {
  type        = string
  description = "hypercli version baked in (image name and hyper:version tag)"
}

variable "variant" {
  type        = string
  default     = "cpu"
  description = "cpu, or gpu (adds the NVIDIA driver and container toolkit)"
}

variable "stamp" {
  type        = string
  description = "build stamp, YYYYMMDDhhmm (image names must be unique)"
}

variable "bundle" {
  type        = string
  description = "tar of hypercli's code made by `hyper image build` (installed in /opt/hypercli)"
}

variable "prepull" {
  type        = string
  default     = ""
  description = "container images pulled into the image, separated by spaces"
}

variable "aws_region" {
  type    = string
  default = "us-east-1"
}

variable "aws_instance_type" {
  type    = string
  default = "t3.large"
}

variable "gcp_project" {
  type    = string
  default = ""
}

variable "gcp_zone" {
  type    = string
  default = "us-central1-a"
}

variable "azure_subscription_id" {
  type    = string
  default = ""
}

variable "azure_resource_group" {
  type    = string
  default = "hyper-images"
}

variable "azure_location" {
  type    = string
  default = "eastus"
}

variable "disk_gb" {
  type    = number
  default = 40
}

locals {
  name = "hyper-node-${var.variant}-${replace(var.hyper_version, ".", "-")}-${var.stamp}"
  tags = {
    "hyper:image"   = "node"
    "hyper:variant" = var.variant
    "hyper:version" = var.hyper_version
  }
  labels = {
    "hyper-image"   = "node"
    "hyper-variant" = var.variant
    "hyper-version" = replace(var.hyper_version, ".", "-")
  }
}

source "amazon-ebs" "node" {
  region        = var.aws_region
  instance_type = var.aws_instance_type
  ssh_username  = "ubuntu"
  ami_name      = local.name
  source_ami_filter {
    filters = {
      name                = "ubuntu/images/hvm-ssd/ubuntu-jammy-22.04-amd64-server-*"
      virtualization-type = "hvm"
    }
    owners      = ["099720109477"]
    most_recent = true
  }
  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = var.disk_gb
    volume_type           = "gp3"
    iops                  = 3000
    throughput            = 125
    delete_on_termination = true
  }
  tags     = local.tags
  run_tags = local.tags
}

source "googlecompute" "node" {
  project_id          = var.gcp_project
  zone                = var.gcp_zone
  source_image_family = "ubuntu-2204-lts"
  ssh_username        = "ubuntu"
  image_name          = local.name
  image_labels        = local.labels
  disk_size           = var.disk_gb
}

source "azure-arm" "node" {
  use_azure_cli_auth                = true
  subscription_id                   = var.azure_subscription_id
  managed_image_name                = local.name
  managed_image_resource_group_name = var.azure_resource_group
  os_type                           = "Linux"
  image_publisher                   = "Canonical"
  image_offer                       = "0001-com-ubuntu-server-jammy"
  image_sku                         = "22_04-lts"
  location                          = var.azure_location
  vm_size                           = "Standard_D2s_v5"
  os_disk_size_gb                   = var.disk_gb
  azure_tags                        = local.tags
}

build {
  sources = ["source.amazon-ebs.node", "source.googlecompute.node", "source.azure-arm.node"]

  provisioner "shell" {
    inline = ["mkdir -p /tmp/hyper-provision"]
  }

  provisioner "file" {
    sources     = ["${path.root}/scripts/", var.bundle]
    destination = "/tmp/hyper-provision/"
  }

  provisioner "shell" {
    execute_command = "sudo -E sh -c '{{ .Vars }} {{ .Path }}'"
    environment_vars = [
      "HYPER_VARIANT=${var.variant}",
      "HYPER_PREPULL=${var.prepull}",
      "HYPER_BUNDLE=/tmp/hyper-provision/${basename(var.bundle)}",
    ]
    inline = ["sh /tmp/hyper-provision/provision.sh"]
  }
}
