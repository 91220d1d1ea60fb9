// Command kubeletclient calls a device plugin's Allocate the way the kubelet does, and prints the
// latency percentiles as one JSON object: {"p50_ms": ..., "p99_ms": ...}.
//
// Usage: kubeletclient [-calls N] [-warmup N] SOCKET DEVICE_ID...
//
// The connection is made as in the kubelet's device manager
// (pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go: dial) with the kubelet's own generated
// stubs. As the kubelet does once a plugin registers, it first opens ListAndWatch and keeps reading
// it; then each Allocate carries one container request with one device id, cycling through the ids
// given, one call at a time.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"sort"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

func dial(socket string) (*grpc.ClientConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	//nolint:staticcheck // grpc.DialContext and WithBlock: what the kubelet calls.
	return grpc.DialContext(ctx, socket,
		grpc.WithAuthority("localhost"),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
	)
}

func main() {
	calls := flag.Int("calls", 10000, "timed Allocate calls")
	warmup := flag.Int("warmup", 500, "untimed Allocate calls first")
	flag.Parse()
	if flag.NArg() < 2 || *calls < 1 {
		fmt.Fprintln(os.Stderr, "usage: kubeletclient [-calls N] [-warmup N] SOCKET DEVICE_ID...")
		os.Exit(2)
	}
	conn, err := dial(flag.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		os.Exit(1)
	}
	defer conn.Close()
	client := pluginapi.NewDevicePluginClient(conn)
	stream, err := client.ListAndWatch(context.Background(), &pluginapi.Empty{})
	if err == nil {
		_, err = stream.Recv()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "ListAndWatch:", err)
		os.Exit(1)
	}
	go func() {
		for {
			if _, err := stream.Recv(); err != nil {
				return
			}
		}
	}()
	ids := flag.Args()[1:]
	allocate := func(n int) {
		_, err := client.Allocate(context.Background(), &pluginapi.AllocateRequest{
			ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{ids[n%len(ids)]}}},
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "allocate:", err)
			os.Exit(1)
		}
	}
	for n := 0; n < *warmup; n++ {
		allocate(n)
	}
	samples := make([]float64, *calls)
	for n := range samples {
		start := time.Now()
		allocate(n)
		samples[n] = float64(time.Since(start).Nanoseconds()) / 1e6
	}
	sort.Float64s(samples)
	// The same percentiles as the Python client: statistics.median and sorted[int(n*0.99)-1].
	mid := len(samples) / 2
	p50 := samples[mid]
	if len(samples)%2 == 0 {
		p50 = (samples[mid-1] + samples[mid]) / 2
	}
	p99 := samples[max(int(float64(len(samples))*0.99)-1, 0)]
	out, _ := json.Marshal(map[string]float64{"p50_ms": p50, "p99_ms": p99})
	fmt.Println(string(out))
}
