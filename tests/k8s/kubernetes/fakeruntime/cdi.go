// CDI for the fake runtime: resolve each container's CDI device IDs against the spec files in
// the node's CDI spec directory and merge their container edits, as containerd does with CDI on
// (tags.cncf.io/container-device-interface's cache: a spec that does not parse or validate adds
// no devices, a device defined by two specs is removed as a conflict, an ID that does not
// resolve fails the container).
//
// Only what the tests assert is modelled: env, device nodes and mounts, spec-wide and per
// device. Hooks and the other OCI edits are accepted and ignored, as no container runs here.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"sigs.k8s.io/yaml"
)

const (
	maxSpecBytes = 1 << 20 // a spec file larger than this is refused, not read
	maxSpecFiles = 4096    // a directory with more spec files resolves nothing
	maxSpecErrs  = 8       // spec errors named in one container's error
)

// The CDI spec format (cdiVersion, kind, devices[].containerEdits, containerEdits), the part of
// it this runtime applies.
type cdiSpec struct {
	Version        string      `json:"cdiVersion"`
	Kind           string      `json:"kind"`
	Devices        []cdiDevice `json:"devices"`
	ContainerEdits cdiEdits    `json:"containerEdits"`
}

type cdiDevice struct {
	Name           string   `json:"name"`
	ContainerEdits cdiEdits `json:"containerEdits"`
}

type cdiEdits struct {
	Env         []string        `json:"env,omitempty"`
	DeviceNodes []cdiDeviceNode `json:"deviceNodes,omitempty"`
	Mounts      []cdiMount      `json:"mounts,omitempty"`
}

type cdiDeviceNode struct {
	Path        string `json:"path"`
	HostPath    string `json:"hostPath,omitempty"`
	Type        string `json:"type,omitempty"`
	Permissions string `json:"permissions,omitempty"`
}

type cdiMount struct {
	HostPath      string   `json:"hostPath"`
	ContainerPath string   `json:"containerPath"`
	Options       []string `json:"options,omitempty"`
	Type          string   `json:"type,omitempty"`
}

// The spec versions the CDI library v1.1.0 accepts.
var cdiVersions = map[string]bool{
	"0.3.0": true, "0.4.0": true, "0.5.0": true, "0.6.0": true, "0.7.0": true, "0.8.0": true,
	"1.0.0": true, "1.1.0": true,
}

// What a container got from its CDI devices: the edits merged in request order (the spec-wide
// edits of a spec once, before its first device), and the spec file each ID resolved in.
type cdiResult struct {
	Specs       map[string]string `json:"specs"`
	Env         map[string]string `json:"env"`
	DeviceNodes []cdiDeviceNode   `json:"deviceNodes"`
	Mounts      []cdiMount        `json:"mounts"`
	Unresolved  []string          `json:"unresolved"`
}

type cdiFile struct {
	size    int64
	modTime int64
	spec    *cdiSpec
	err     error
}

type cdiRegistry struct {
	dir string
	// Kinds whose IDs are recorded as unresolved instead of failing the container: the test bed
	// has no NVIDIA container toolkit to write their specs (the device plugin's nvidia.com/gpu).
	lenient map[string]bool
	mu      sync.Mutex
	files   map[string]cdiFile // parsed specs, keyed by path, reused while size and mtime hold
}

func newCDIRegistry(dir string, lenient []string) *cdiRegistry {
	kinds := map[string]bool{}
	for _, k := range lenient {
		kinds[k] = true
	}
	return &cdiRegistry{dir: dir, lenient: kinds, files: map[string]cdiFile{}}
}

type cdiEntry struct {
	spec   *cdiSpec
	device *cdiDevice
	path   string
}

// resolve the IDs against the spec directory as it is now (the kubelet's DRA plugin writes a
// claim's spec just before the container is created).
func (r *cdiRegistry) resolve(ids []string) (*cdiResult, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	devices, specErrs := r.load()
	result := &cdiResult{Specs: map[string]string{}, Env: map[string]string{}, DeviceNodes: []cdiDeviceNode{}, Mounts: []cdiMount{}, Unresolved: []string{}}
	var missing []string
	var picked []cdiEntry
	for _, id := range ids {
		kind, _, err := parseCDIName(id)
		if err != nil {
			return nil, fmt.Errorf("CDI device injection failed: %w", err)
		}
		entry, ok := devices[id]
		switch {
		case ok:
			picked = append(picked, entry)
			result.Specs[id] = entry.path
		case r.lenient[kind]:
			result.Unresolved = append(result.Unresolved, id)
		default:
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		msg := "CDI device injection failed: unresolvable CDI devices " + strings.Join(missing, ", ") + " in " + r.dir
		if len(specErrs) > 0 {
			if len(specErrs) > maxSpecErrs {
				specErrs = append(specErrs[:maxSpecErrs], fmt.Sprintf("and %d more", len(specErrs)-maxSpecErrs))
			}
			msg += " (spec errors: " + strings.Join(specErrs, "; ") + ")"
		}
		return nil, fmt.Errorf("%s", msg)
	}
	applied := map[*cdiSpec]bool{}
	for _, e := range picked {
		if !applied[e.spec] {
			applied[e.spec] = true
			result.apply(e.spec.ContainerEdits)
		}
		result.apply(e.device.ContainerEdits)
	}
	return result, nil
}

// apply one set of edits: a later env value of a key replaces an earlier one, a device node or
// mount replaces one at the same container path (the OCI spec generator's rules).
func (c *cdiResult) apply(e cdiEdits) {
	for _, kv := range e.Env {
		k, v, _ := strings.Cut(kv, "=")
		c.Env[k] = v
	}
	for _, d := range e.DeviceNodes {
		if d.HostPath == "" {
			d.HostPath = d.Path
		}
		kept := c.DeviceNodes[:0]
		for _, old := range c.DeviceNodes {
			if old.Path != d.Path {
				kept = append(kept, old)
			}
		}
		c.DeviceNodes = append(kept, d)
	}
	for _, m := range e.Mounts {
		kept := c.Mounts[:0]
		for _, old := range c.Mounts {
			if old.ContainerPath != m.ContainerPath {
				kept = append(kept, old)
			}
		}
		c.Mounts = append(kept, m)
	}
}

// load every spec file of the directory: the devices by qualified name, and one line per file
// that does not parse or validate, or per device two files define.
func (r *cdiRegistry) load() (map[string]cdiEntry, []string) {
	if r.dir == "" {
		return map[string]cdiEntry{}, []string{"no CDI spec directory given (--cdi-spec-dir)"}
	}
	entries, err := os.ReadDir(r.dir)
	if err != nil {
		if os.IsNotExist(err) {
			return map[string]cdiEntry{}, nil
		}
		return map[string]cdiEntry{}, []string{err.Error()}
	}
	var paths []string
	for _, e := range entries {
		ext := filepath.Ext(e.Name())
		if e.Type().IsRegular() && (ext == ".json" || ext == ".yaml") {
			paths = append(paths, filepath.Join(r.dir, e.Name()))
		}
	}
	if len(paths) > maxSpecFiles {
		return map[string]cdiEntry{}, []string{fmt.Sprintf("%s holds %d spec files, more than %d", r.dir, len(paths), maxSpecFiles)}
	}
	sort.Strings(paths)
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[string]bool{}
	devices := map[string]cdiEntry{}
	conflicts := map[string][]string{}
	var errs []string
	for _, path := range paths {
		seen[path] = true
		f := r.read(path)
		if f.err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", filepath.Base(path), f.err))
			continue
		}
		for i := range f.spec.Devices {
			d := &f.spec.Devices[i]
			id := f.spec.Kind + "=" + d.Name
			if old, dup := devices[id]; dup {
				conflicts[id] = append(conflicts[id], old.path, path)
				continue
			}
			devices[id] = cdiEntry{spec: f.spec, device: d, path: path}
		}
	}
	for path := range r.files {
		if !seen[path] {
			delete(r.files, path)
		}
	}
	for id, in := range conflicts {
		delete(devices, id)
		errs = append(errs, fmt.Sprintf("conflicting device %q (specs %s)", id, strings.Join(in, ", ")))
	}
	sort.Strings(errs)
	return devices, errs
}

// read one spec file, reusing the last parse while its size and modification time hold.
func (r *cdiRegistry) read(path string) cdiFile {
	info, err := os.Stat(path)
	if err != nil {
		return cdiFile{err: err}
	}
	if f, ok := r.files[path]; ok && f.size == info.Size() && f.modTime == info.ModTime().UnixNano() {
		return f
	}
	f := cdiFile{size: info.Size(), modTime: info.ModTime().UnixNano()}
	if info.Size() > maxSpecBytes {
		f.err = fmt.Errorf("%d bytes, more than %d", info.Size(), maxSpecBytes)
	} else if data, err := os.ReadFile(path); err != nil {
		f.err = err
	} else {
		f.spec, f.err = parseCDISpec(data)
	}
	r.files[path] = f
	return f
}

// parseCDISpec reads one spec (YAML or JSON) and validates what the CDI library validates of it.
func parseCDISpec(data []byte) (*cdiSpec, error) {
	var s cdiSpec
	if err := yaml.Unmarshal(data, &s); err != nil {
		return nil, fmt.Errorf("failed to unmarshal CDI Spec: %w", err)
	}
	if !cdiVersions[s.Version] {
		return nil, fmt.Errorf("invalid cdiVersion %q", s.Version)
	}
	vendor, class, ok := strings.Cut(s.Kind, "/")
	if !ok {
		return nil, fmt.Errorf("invalid kind %q, want vendor/class", s.Kind)
	}
	if err := validKindPart(vendor); err != nil {
		return nil, fmt.Errorf("invalid vendor. %w", err)
	}
	if err := validKindPart(class); err != nil {
		return nil, fmt.Errorf("invalid class. %w", err)
	}
	if err := s.ContainerEdits.validate(); err != nil {
		return nil, err
	}
	if len(s.Devices) == 0 {
		return nil, fmt.Errorf("invalid spec, no devices")
	}
	names := map[string]bool{}
	for _, d := range s.Devices {
		if err := validDeviceName(d.Name); err != nil {
			return nil, fmt.Errorf("failed add device %q: %w", d.Name, err)
		}
		if names[d.Name] {
			return nil, fmt.Errorf("invalid spec, multiple device %q", d.Name)
		}
		names[d.Name] = true
		if err := d.ContainerEdits.validate(); err != nil {
			return nil, fmt.Errorf("failed add device %q: %w", d.Name, err)
		}
	}
	return &s, nil
}

func (e cdiEdits) validate() error {
	for _, kv := range e.Env {
		if strings.IndexByte(kv, '=') <= 0 {
			return fmt.Errorf("invalid environment variable %q", kv)
		}
	}
	for _, d := range e.DeviceNodes {
		if d.Path == "" {
			return fmt.Errorf("invalid (empty) device path")
		}
		if !strings.Contains(" b c u p", " "+d.Type) {
			return fmt.Errorf("device %q: invalid type %q", d.Path, d.Type)
		}
	}
	for _, m := range e.Mounts {
		if m.HostPath == "" {
			return fmt.Errorf("invalid mount, empty host path")
		}
		if m.ContainerPath == "" {
			return fmt.Errorf("invalid mount, empty container path")
		}
	}
	return nil
}

// parseCDIName splits vendor/class=name and checks each part as the CDI parser does.
func parseCDIName(id string) (kind, name string, err error) {
	kind, name, ok := strings.Cut(id, "=")
	vendor, class, slash := strings.Cut(kind, "/")
	if !ok || !slash {
		return "", "", fmt.Errorf("unqualified device %q, missing vendor/class=name", id)
	}
	if err := validKindPart(vendor); err != nil {
		return "", "", fmt.Errorf("invalid device %q: invalid vendor. %w", id, err)
	}
	if err := validKindPart(class); err != nil {
		return "", "", fmt.Errorf("invalid device %q: invalid class. %w", id, err)
	}
	if err := validDeviceName(name); err != nil {
		return "", "", fmt.Errorf("invalid device %q: %w", id, err)
	}
	return kind, name, nil
}

func alnum(c byte) bool  { return c >= '0' && c <= '9' || letter(c) }
func letter(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }

// A vendor or class: a letter first, a letter or digit last, and letters, digits, '_', '-', '.'.
func validKindPart(s string) error {
	if s == "" {
		return fmt.Errorf("empty name")
	}
	if !letter(s[0]) {
		return fmt.Errorf("%q, should start with letter", s)
	}
	if !alnum(s[len(s)-1]) {
		return fmt.Errorf("%q, should end with a letter or digit", s)
	}
	for i := 1; i < len(s)-1; i++ {
		if c := s[i]; !alnum(c) && c != '_' && c != '-' && c != '.' {
			return fmt.Errorf("invalid character '%c' in name %q", c, s)
		}
	}
	return nil
}

// A device name: a letter or digit first and last, and letters, digits, '_', '-', '.', ':'.
func validDeviceName(s string) error {
	if s == "" {
		return fmt.Errorf("invalid (empty) device name")
	}
	if !alnum(s[0]) || !alnum(s[len(s)-1]) {
		return fmt.Errorf("invalid device name %q, should start and end with a letter or digit", s)
	}
	for i := 1; i < len(s)-1; i++ {
		if c := s[i]; !alnum(c) && c != '_' && c != '-' && c != '.' && c != ':' {
			return fmt.Errorf("invalid character '%c' in device name %q", c, s)
		}
	}
	return nil
}
