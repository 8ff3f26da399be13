#!/usr/bin/env bash
# Image step of Dockerfile.canary-roce only: the RDMA-over-Converged-Ethernet transport layer
# (verbs user space and diagnostics) for NCCL's IB transport. ROCE_SIMULATE=1 resolves and
# simulates the install without changing the machine (CI runs it that way outside docker).
set -euo pipefail
PACKAGES=(rdma-core ibverbs-providers libibverbs1 librdmacm1 ibverbs-utils infiniband-diags)
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
if [[ "${ROCE_SIMULATE:-0}" == "1" ]]; then
  apt-get install -s -y -qq --no-install-recommends "${PACKAGES[@]}"
  exit 0
fi
apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
rm -rf /var/lib/apt/lists/*
