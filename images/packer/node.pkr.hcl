# hypercli node image for AWS (amazon-ebs), GCP (googlecompute) and Azure (azure-arm).
# One build, three sources, one set of provisioning scripts (scripts/). `hyper image build`
# runs it with -only=<source> and the variables below; see README.md in this folder.
# Valid for Debian's Packer 1.6.6 (builders built in) and for current Packer, which also reads
# plugins.pkr.hcl (`packer init images/packer`).

variable "hyper_version" {
  type        = string
  description = "hypercli version baked in (image name and hyper:version tag)"
}

variable "variant" {
  type        = string
  default     = "cpu"
  description = "cpu, or gpu (adds the NVIDIA driver and container toolkit)"
  validation {
    condition     = contains(["cpu", "gpu"], var.variant)
    error_message = "The variant must be cpu or gpu."
  }
}

variable "stamp" {
  type        = string
  description = "build stamp, UTC YYYYMMDDhhmmss (image names must be unique)"
  validation {
    condition     = length(var.stamp) > 0 && regex_replace(var.stamp, "[0-9]", "") == ""
    error_message = "The stamp must be digits (UTC YYYYMMDDhhmmss)."
  }
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

variable "engines" {
  type        = string
  default     = ""
  description = "engines for `engine:` experiments baked in: spark (Java 17 + pyspark), ray, or both, separated by spaces"
}

variable "skip" {
  type        = string
  default     = ""
  description = "provisioning steps to leave out, separated by spaces (scripts/provision.sh)"
}

variable "nvidia_driver" {
  type        = string
  default     = "535-server"
  description = "gpu variant: Ubuntu NVIDIA driver branch (ubuntu-drivers --gpgpu nvidia:<this>)"
}

variable "disk_gb" {
  type        = number
  default     = 40
  description = "root disk of the image, GiB"
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
  default = env("GOOGLE_CLOUD_PROJECT")
}

variable "gcp_zone" {
  type    = string
  default = "us-central1-a"
}

variable "gcp_machine_type" {
  type    = string
  default = "e2-standard-2"
}

variable "azure_subscription_id" {
  type    = string
  default = env("AZURE_SUBSCRIPTION_ID")
}

variable "azure_client_id" {
  type        = string
  default     = env("AZURE_CLIENT_ID")
  description = "service principal; empty: the Azure CLI's login (az login)"
}

variable "azure_client_secret" {
  type      = string
  default   = env("AZURE_CLIENT_SECRET")
  sensitive = true
}

variable "azure_tenant_id" {
  type    = string
  default = env("AZURE_TENANT_ID")
}

variable "azure_resource_group" {
  type        = string
  default     = "hyper-images"
  description = "an existing resource group that receives the managed image"
}

variable "azure_location" {
  type    = string
  default = "eastus"
}

variable "azure_vm_size" {
  type    = string
  default = "Standard_D2s_v5"
}

locals {
  # the same rules as hypercli.images.image_name and hypercli.providers.gcp.label_value
  version_slug  = substr(regex_replace(lower(var.hyper_version), "[^a-z0-9]", "-"), 0, 24)
  version_label = substr(regex_replace(lower(var.hyper_version), "[^a-z0-9_-]", "-"), 0, 63)
  name          = "hyper-node-${var.variant}-${local.version_slug}-${var.stamp}"
  tags = {
    "hyper:image"   = "node"
    "hyper:variant" = var.variant
    "hyper:version" = var.hyper_version
  }
  labels = {
    "hyper-image"   = "node"
    "hyper-variant" = var.variant
    "hyper-version" = local.version_label
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
      root-device-type    = "ebs"
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
  tags          = local.tags
  snapshot_tags = local.tags
  run_tags      = local.tags
}

source "googlecompute" "node" {
  project_id          = var.gcp_project
  zone                = var.gcp_zone
  machine_type        = var.gcp_machine_type
  source_image_family = "ubuntu-2204-lts"
  ssh_username        = "ubuntu"
  image_name          = local.name
  image_description   = "hypercli node image (${var.variant}, hypercli ${var.hyper_version})"
  image_labels        = local.labels
  disk_size           = var.disk_gb
}

source "azure-arm" "node" {
  subscription_id                   = var.azure_subscription_id
  client_id                         = var.azure_client_id
  client_secret                     = var.azure_client_secret
  tenant_id                         = var.azure_tenant_id
  use_azure_cli_auth                = var.azure_client_id == ""
  managed_image_name                = local.name
  managed_image_resource_group_name = var.azure_resource_group
  os_type                           = "Linux"
  image_publisher                   = "Canonical"
  image_offer                       = "0001-com-ubuntu-server-jammy"
  image_sku                         = "22_04-lts"
  location                          = var.azure_location
  vm_size                           = var.azure_vm_size
  os_disk_size_gb                   = var.disk_gb
  azure_tags                        = local.tags
}

build {
  sources = ["source.amazon-ebs.node", "source.googlecompute.node", "source.azure-arm.node"]

  provisioner "shell" {
    inline = ["rm -rf /tmp/hyper-provision", "mkdir -p /tmp/hyper-provision"]
  }

  provisioner "file" {
    sources     = ["${path.root}/scripts/", var.bundle]
    destination = "/tmp/hyper-provision/"
  }

  provisioner "shell" {
    # the variables are set for sudo, which keeps them (-E; no sudo when Packer is root)
    execute_command = "chmod +x {{ .Path }}; {{ .Vars }} $([ \"$(id -u)\" = 0 ] || echo sudo -E) sh -e '{{ .Path }}'"
    environment_vars = [
      "HYPER_VARIANT=${var.variant}",
      "HYPER_SKIP=${var.skip}",
      "HYPER_PREPULL=${var.prepull}",
      "HYPER_ENGINES=${var.engines}",
      "HYPER_NVIDIA_DRIVER=${var.nvidia_driver}",
      "HYPER_BUNDLE=/tmp/hyper-provision/${basename(var.bundle)}",
    ]
    inline = ["sh /tmp/hyper-provision/provision.sh", "rm -rf /tmp/hyper-provision"]
  }

  # Azure: a generalized image must be deprovisioned last (the azure-arm builder's docs)
  provisioner "shell" {
    only            = ["azure-arm.node"]
    execute_command = "chmod +x {{ .Path }}; {{ .Vars }} sudo -E sh '{{ .Path }}'"
    inline          = ["/usr/sbin/waagent -force -deprovision+user && export HISTSIZE=0 && sync"]
    skip_clean      = true
  }
}
