//go:build tools

// Package tools pins the command the rig builds, so `go mod tidy` keeps it.
package tools

import _ "helm.sh/helm/v4/cmd/helm"
