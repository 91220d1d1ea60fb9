// Command fakeruntime is the container runtime of the e2e tests' real-kubelet nodes: the
// Kubernetes project's own fake CRI server (k8s.io/cri-client/pkg/fake) on a unix socket, with
// what a kubelet needs to run pods on it and a record of what the kubelet asked for.
//
// Changes to the upstream fake, each needed by a real kubelet:
//   - images have a size: the kubelet refuses images without one ("Id or size of image is not set");
//   - every container gets a real log file under the sandbox's log directory: with an empty
//     LogPath the kubelet's log clean-up removes files matching * in its working directory;
//   - a container whose environment sets FAKE_RUNTIME_EXIT_CODE exits with that code as soon as
//     it starts, so init containers finish and pods move on to their app containers;
//   - each pod gets a loopback address of its own where its declared container ports answer
//     (probes.go), so the kubelet's HTTP, HTTPS and TCP probes pass and pods become Ready;
//   - a container's CDI devices are resolved against the spec files in --cdi-spec-dir, as
//     containerd does (cdi.go): an ID no spec defines fails CreateContainer, and the edits of
//     the ones that resolve are merged into what the container gets.
//
// Every CreateContainer request is appended as one JSON line to --record (pod, container, env,
// device nodes, mounts, CDI devices and what they resolved to, annotations): what the kubelet
// handed to the runtime after the device plugin's Allocate or the DRA plugins' Prepare, with the
// CDI edits applied.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
	"k8s.io/cri-client/pkg/util"
)

const exitEnv = "FAKE_RUNTIME_EXIT_CODE"

type runtime struct {
	*fake.RemoteRuntime
	record *os.File
	net    *network
	cdi    *cdiRegistry
	mu     sync.Mutex
	exits  map[string]int32 // container id -> the exit code its FAKE_RUNTIME_EXIT_CODE asks for
}

type mount struct {
	ContainerPath string `json:"containerPath"`
	HostPath      string `json:"hostPath"`
	ReadOnly      bool   `json:"readOnly"`
}

type created struct {
	Namespace   string            `json:"namespace"`
	Pod         string            `json:"pod"`
	PodUID      string            `json:"podUID"`
	Container   string            `json:"container"`
	Env         map[string]string `json:"env"`
	Devices     []string          `json:"devices"`
	Mounts      []mount           `json:"mounts"`
	CDIDevices  []string          `json:"cdiDevices"`
	CDI         *cdiResult        `json:"cdi"`
	Annotations map[string]string `json:"annotations"`
	At          float64           `json:"at"`
}

func (r *runtime) CreateContainer(ctx context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	var ids []string
	for _, d := range req.GetConfig().GetCDIDevices() {
		ids = append(ids, d.GetName())
	}
	// Resolved before anything is created: a container whose CDI device does not resolve is
	// never made, and the kubelet reports the error on the pod (CreateContainerError).
	cdi, err := r.cdi.resolve(ids)
	if err != nil {
		return nil, err
	}
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	config, sandbox := req.GetConfig(), req.GetSandboxConfig()
	logPath := filepath.Join(sandbox.GetLogDirectory(), config.GetLogPath())
	if config.GetLogPath() != "" {
		if err := os.MkdirAll(filepath.Dir(logPath), 0o755); err == nil {
			if f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
				f.Close()
			}
		}
	}
	svc := r.RuntimeService
	svc.Lock()
	if c, ok := svc.Containers[resp.ContainerId]; ok {
		c.LogPath = logPath
	}
	svc.Unlock()

	entry := created{
		Namespace:   sandbox.GetMetadata().GetNamespace(),
		Pod:         sandbox.GetMetadata().GetName(),
		PodUID:      sandbox.GetMetadata().GetUid(),
		Container:   config.GetMetadata().GetName(),
		Env:         map[string]string{},
		Devices:     []string{},
		Mounts:      []mount{},
		CDIDevices:  append([]string{}, ids...),
		CDI:         cdi,
		Annotations: config.GetAnnotations(),
		At:          float64(time.Now().UnixNano()) / 1e9,
	}
	for _, kv := range config.GetEnvs() {
		entry.Env[kv.GetKey()] = string(kv.GetValue())
	}
	for _, d := range config.GetDevices() {
		entry.Devices = append(entry.Devices, d.GetHostPath())
	}
	for _, m := range config.GetMounts() {
		entry.Mounts = append(entry.Mounts, mount{m.GetContainerPath(), m.GetHostPath(), m.GetReadonly()})
	}
	// What the container really gets: the CDI edits on top of what the kubelet asked for.
	if cdi != nil {
		for k, v := range cdi.Env {
			entry.Env[k] = v
		}
		for _, d := range cdi.DeviceNodes {
			entry.Devices = append(entry.Devices, d.HostPath)
		}
		for _, m := range cdi.Mounts {
			entry.Mounts = append(entry.Mounts, mount{m.ContainerPath, m.HostPath, hasOption(m.Options, "ro")})
		}
	}
	line, err := json.Marshal(entry)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakeruntime: record:", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	_, _ = r.record.Write(append(line, '\n'))
	if code, err := strconv.Atoi(entry.Env[exitEnv]); err == nil {
		r.exits[resp.ContainerId] = int32(code)
	}
	return resp, nil
}

func (r *runtime) StartContainer(ctx context.Context, req *runtimeapi.StartContainerRequest) (*runtimeapi.StartContainerResponse, error) {
	resp, err := r.RemoteRuntime.StartContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	code, exits := r.exits[req.GetContainerId()]
	r.mu.Unlock()
	svc := r.RuntimeService
	svc.Lock()
	defer svc.Unlock()
	if c, ok := svc.Containers[req.GetContainerId()]; ok && exits {
		c.State = runtimeapi.ContainerState_CONTAINER_EXITED
		c.FinishedAt = time.Now().UnixNano()
		c.ExitCode = code
		c.Reason = "Completed"
	}
	return resp, nil
}

func hasOption(options []string, want string) bool {
	for _, o := range options {
		if o == want {
			return true
		}
	}
	return false
}

// kinds is a repeatable flag.
type kinds []string

func (k *kinds) String() string     { return strings.Join(*k, ",") }
func (k *kinds) Set(v string) error { *k = append(*k, v); return nil }

func main() {
	listen := flag.String("listen", "", "unix socket path to serve the CRI on")
	record := flag.String("record", "", "file to append one JSON line per CreateContainer to")
	cdiDir := flag.String("cdi-spec-dir", "", "directory of CDI spec files (.json, .yaml) to resolve CDI devices against")
	var lenient kinds
	flag.Var(&lenient, "cdi-unresolved-kind", "a CDI kind (vendor/class) whose IDs are recorded as unresolved instead of failing the container (repeatable)")
	flag.Parse()
	if *listen == "" || *record == "" {
		fmt.Fprintln(os.Stderr, "usage: fakeruntime --listen PATH --record FILE")
		os.Exit(2)
	}
	out, err := os.OpenFile(*record, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	pods, err := newNetwork()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	r := &runtime{RemoteRuntime: fake.NewFakeRemoteRuntime(), record: out, net: pods, cdi: newCDIRegistry(*cdiDir, lenient), exits: map[string]int32{}}
	r.ImageService.SetFakeImageSize(4 << 20)
	r.RuntimeService.FakeStatus = &runtimeapi.RuntimeStatus{
		Conditions: []*runtimeapi.RuntimeCondition{
			{Type: runtimeapi.RuntimeReady, Status: true},
			{Type: runtimeapi.NetworkReady, Status: true},
		},
	}
	r.RuntimeService.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{
		CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS,
	}
	server := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(server, r)
	runtimeapi.RegisterImageServiceServer(server, r)
	_ = os.Remove(*listen)
	l, err := util.CreateListener("unix://" + *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		server.Stop()
	}()
	fmt.Fprintf(os.Stderr, "fakeruntime: serving on %s\n", *listen)
	if err := server.Serve(l); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
}
