//go:build tools

// Package node pins the commands provision.sh builds from this module.
package node

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
	_ "github.com/opencontainers/runc"
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
)
