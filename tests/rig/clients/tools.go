//go:build tools

// Package tools pins the commands the rig builds, so `go mod tidy` keeps them.
package tools

import _ "github.com/nats-io/natscli/nats"
