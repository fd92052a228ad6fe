//go:build tools

// Package tools pins the linters `make test` runs, so `go mod tidy` keeps them.
package tools

import _ "github.com/rhysd/actionlint/cmd/actionlint"
