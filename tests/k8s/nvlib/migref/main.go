// Command migref answers MIG profile name questions with NVIDIA's own parser (go-nvlib's
// pkg/nvlib/device, which NVIDIA's device plugin, GPU feature discovery and mig-parted use), so
// that gpupart's tests can compare gpupart's profile names with NVIDIA's
// (tests/core/test_reference_kubernetes.py).
//
// One JSON question per line on stdin, one JSON answer per line on stdout:
//
//	profile: {"text": "1g.10gb+me", "info": Info|null}
//	         -> {"error"} (AssertValidMigProfileFormat: "" when the name parses), and with
//	         info also {"matches"} (MigProfileInfo.Matches: the name means exactly that profile)
//	name:    {"info": Info} -> {"name"} (MigProfileInfo.String: the name NVIDIA gives it)
//
// Info is {"c", "g", "gb", "attributes", "negAttributes"}. The parser never calls NVML.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
)

type info struct {
	C             int      `json:"c"`
	G             int      `json:"g"`
	GB            int      `json:"gb"`
	Attributes    []string `json:"attributes"`
	NegAttributes []string `json:"negAttributes"`
}

type question struct {
	Op   string `json:"op"`
	Text string `json:"text"`
	Info *info  `json:"info"`
}

type answer map[string]any

func main() {
	// The format check needs no NVML library: it parses text only.
	lib := device.New(nil)
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	out := bufio.NewWriter(os.Stdout)
	encoder := json.NewEncoder(out)
	for in.Scan() {
		var q question
		var a answer
		if err := json.Unmarshal(in.Bytes(), &q); err != nil {
			a = answer{"fault": err.Error()}
		} else {
			a = respond(lib, &q)
		}
		if err := encoder.Encode(a); err != nil {
			fmt.Fprintln(os.Stderr, "migref:", err)
			os.Exit(1)
		}
		if err := out.Flush(); err != nil {
			os.Exit(1)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "migref:", err)
		os.Exit(1)
	}
}

func profileOf(i *info) device.MigProfileInfo {
	return device.MigProfileInfo{C: i.C, G: i.G, GB: i.GB, Attributes: i.Attributes, NegAttributes: i.NegAttributes}
}

func respond(lib device.Interface, q *question) answer {
	switch q.Op {
	case "profile":
		a := answer{"error": ""}
		if err := lib.AssertValidMigProfileFormat(q.Text); err != nil {
			a["error"] = err.Error()
		}
		if q.Info != nil {
			a["matches"] = profileOf(q.Info).Matches(q.Text)
		}
		return a
	case "name":
		if q.Info == nil {
			return answer{"fault": "name needs info"}
		}
		return answer{"name": profileOf(q.Info).String()}
	}
	return answer{"fault": fmt.Sprintf("unknown op %q", q.Op)}
}
