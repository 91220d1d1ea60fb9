// Tests of the fake runtime's CDI resolution (cdi.go), run by tests/integration/test_fakeruntime_cdi.py.
package main

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func write(t *testing.T, dir, name, text string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

const claimSpec = `cdiVersion: 0.6.0
kind: k8s.gpu.example.com/gpu
containerEdits:
  env: [SPEC_WIDE=1, SHARED=spec]
devices:
- name: claim-a
  containerEdits:
    env: [DEVICE=a, SHARED=a]
    deviceNodes: [{path: /dev/a}]
- name: claim-b
  containerEdits:
    env: [DEVICE=b]
    mounts: [{hostPath: /host/b, containerPath: /b, options: [ro]}]
`

func TestEditsMergeInRequestOrderWithSpecWideEditsOnce(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "claim.yaml", claimSpec)
	write(t, dir, "other.json", `{"cdiVersion": "1.0.0", "kind": "vendor.io/x", "devices": [{"name": "0", "containerEdits": {"env": ["DEVICE=x"]}}]}`)
	r := newCDIRegistry(dir, nil)
	got, err := r.resolve([]string{"k8s.gpu.example.com/gpu=claim-a", "k8s.gpu.example.com/gpu=claim-b", "vendor.io/x=0"})
	if err != nil {
		t.Fatal(err)
	}
	wantEnv := map[string]string{"SPEC_WIDE": "1", "SHARED": "a", "DEVICE": "x"}
	if !reflect.DeepEqual(got.Env, wantEnv) {
		t.Fatalf("env %v, want %v", got.Env, wantEnv)
	}
	if len(got.DeviceNodes) != 1 || got.DeviceNodes[0].HostPath != "/dev/a" {
		t.Fatalf("device nodes %+v", got.DeviceNodes)
	}
	if len(got.Mounts) != 1 || got.Mounts[0].ContainerPath != "/b" {
		t.Fatalf("mounts %+v", got.Mounts)
	}
	if got.Specs["vendor.io/x=0"] != filepath.Join(dir, "other.json") || len(got.Specs) != 3 {
		t.Fatalf("specs %v", got.Specs)
	}
}

func TestAnUnresolvableIDFailsWithTheSpecErrorsAndOthersStillResolve(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "claim.yaml", claimSpec)
	write(t, dir, "broken.yaml", "cdiVersion: [")
	write(t, dir, "noversion.json", `{"kind": "vendor.io/x", "devices": [{"name": "0"}]}`)
	write(t, dir, "badenv.json", `{"cdiVersion": "0.6.0", "kind": "vendor.io/y", "devices": [{"name": "0", "containerEdits": {"env": ["=x"]}}]}`)
	write(t, dir, "ignored.txt", "not a spec")
	r := newCDIRegistry(dir, nil)
	if _, err := r.resolve([]string{"k8s.gpu.example.com/gpu=claim-a"}); err != nil {
		t.Fatalf("a malformed file failed an ID it does not define: %v", err)
	}
	_, err := r.resolve([]string{"k8s.gpu.example.com/gpu=claim-a", "vendor.io/x=0", "vendor.io/y=0"})
	if err == nil {
		t.Fatal("resolved IDs no valid spec defines")
	}
	for _, want := range []string{
		"unresolvable CDI devices vendor.io/x=0, vendor.io/y=0 in " + dir,
		"broken.yaml: failed to unmarshal CDI Spec",
		`noversion.json: invalid cdiVersion ""`,
		`badenv.json: failed add device "0": invalid environment variable "=x"`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "ignored.txt") {
		t.Errorf("read a file that is not .json or .yaml: %v", err)
	}
}

func TestADeviceTwoSpecsDefineIsAConflict(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "claim.yaml", claimSpec)
	write(t, dir, "again.json", `{"cdiVersion": "0.6.0", "kind": "k8s.gpu.example.com/gpu", "devices": [{"name": "claim-a"}]}`)
	r := newCDIRegistry(dir, nil)
	_, err := r.resolve([]string{"k8s.gpu.example.com/gpu=claim-a"})
	if err == nil || !strings.Contains(err.Error(), `conflicting device "k8s.gpu.example.com/gpu=claim-a"`) {
		t.Fatalf("want a conflict, got %v", err)
	}
	if _, err := r.resolve([]string{"k8s.gpu.example.com/gpu=claim-b"}); err != nil {
		t.Fatalf("the spec's other device: %v", err)
	}
}

func TestASpecIsReadAgainWhenItChangesAndForgottenWhenRemoved(t *testing.T) {
	dir := t.TempDir()
	r := newCDIRegistry(dir, nil)
	id := "k8s.gpu.example.com/gpu=claim-a"
	if _, err := r.resolve([]string{id}); err == nil {
		t.Fatal("resolved before any spec was written")
	}
	write(t, dir, "claim.yaml", claimSpec)
	if _, err := r.resolve([]string{id}); err != nil {
		t.Fatal(err)
	}
	write(t, dir, "claim.yaml", strings.Replace(claimSpec, "DEVICE=a", "DEVICE=changed", 1))
	got, err := r.resolve([]string{id})
	if err != nil || got.Env["DEVICE"] != "changed" {
		t.Fatalf("after the change: %v %v", got, err)
	}
	os.Remove(filepath.Join(dir, "claim.yaml"))
	if _, err := r.resolve([]string{id}); err == nil {
		t.Fatal("resolved after its spec was removed")
	}
}

func TestBadIDsLenientKindsAndBounds(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "big.json", `{"cdiVersion": "0.6.0", "kind": "vendor.io/big", "devices": [{"name": "0"}], "pad": "`+strings.Repeat("x", maxSpecBytes)+`"}`)
	r := newCDIRegistry(dir, []string{"nvidia.com/gpu"})
	for _, id := range []string{"nokind", "vendor.io/x", "-bad/x=0", "vendor.io/x=-0", "vendor.io/x=a b"} {
		if _, err := r.resolve([]string{id}); err == nil {
			t.Errorf("accepted the malformed ID %q", id)
		}
	}
	got, err := r.resolve([]string{"nvidia.com/gpu=GPU-1"})
	if err != nil || !reflect.DeepEqual(got.Unresolved, []string{"nvidia.com/gpu=GPU-1"}) {
		t.Fatalf("a lenient kind: %v %v", got, err)
	}
	_, err = r.resolve([]string{"vendor.io/big=0"})
	if err == nil || !strings.Contains(err.Error(), "big.json: ") || !strings.Contains(err.Error(), "more than") {
		t.Fatalf("a spec over the size bound: %v", err)
	}
	if got, err := r.resolve(nil); got != nil || err != nil {
		t.Fatalf("no CDI devices: %v %v", got, err)
	}
	if _, err := newCDIRegistry("", nil).resolve([]string{"vendor.io/x=0"}); err == nil || !strings.Contains(err.Error(), "--cdi-spec-dir") {
		t.Fatalf("no directory given: %v", err)
	}
}
