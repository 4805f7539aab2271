# For a current Packer (>= 1.7): `packer init images/packer` installs these plugins.
# Debian's Packer 1.6.6 has the three builders built in and does not understand this block:
# `hyper image build` and the test suite leave this file out when they run that version.
packer {
  required_plugins {
    amazon = {
      version = ">= 1.2.0"
      source  = "github.com/hashicorp/amazon"
    }
    googlecompute = {
      version = ">= 1.1.0"
      source  = "github.com/hashicorp/googlecompute"
    }
    azure = {
      version = ">= 2.0.0"
      source  = "github.com/hashicorp/azure"
    }
  }
}
