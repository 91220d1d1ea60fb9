// Command schedulerclient calls a scheduler extender's filter and prioritize verbs the way
// kube-scheduler does, and prints the latency of each filter+prioritize pair as one JSON object:
// {"ms": [...]}.
//
// Usage: schedulerclient -url URL -requests N -skip N < PLAN.json
//
// PLAN.json is {"names": [...], "shapes": [{"limits": {...}, "app": "..."}], "seed": N}. For each
// pod (cycling through the shapes, each with its own name and uid) the node names are shuffled
// (kube-scheduler's parallel filter lists feasible nodes in a new order for each pod), then the
// pod goes through filter and prioritize with the survivors, timed together, and is bound to the
// best-scored node (not timed), as tests/bench/extender_latency.py's Python client does. Requests are made as in kube-scheduler's HTTPExtender
// (pkg/scheduler/extender.go: send): the extender API's own types (k8s.io/kube-scheduler/
// extender/v1) with a *v1.Pod, encoding/json both ways, one keep-alive net/http client.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand"
	"net/http"
	"os"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

type shape struct {
	Limits map[string]string `json:"limits"`
	App    string            `json:"app"`
}

type plan struct {
	Names  []string `json:"names"`
	Shapes []shape  `json:"shapes"`
	Seed   int64    `json:"seed"`
}

type extender struct {
	url    string
	client *http.Client
}

// send is HTTPExtender.send: marshal, POST, decode the body into result.
func (e *extender) send(action string, args, result any) error {
	out, err := json.Marshal(args)
	if err != nil {
		return err
	}
	req, err := http.NewRequest("POST", strings.TrimRight(e.url, "/")+"/"+action, bytes.NewReader(out))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("failed %v with extender at URL %v, code %v", action, e.url, resp.StatusCode)
	}
	return json.NewDecoder(resp.Body).Decode(result)
}

func pod(i int, s shape) (*v1.Pod, error) {
	limits := v1.ResourceList{}
	for name, value := range s.Limits {
		q, err := resource.ParseQuantity(value)
		if err != nil {
			return nil, fmt.Errorf("shape %v: %w", s, err)
		}
		limits[v1.ResourceName(name)] = q
	}
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:      fmt.Sprintf("p%d", i),
			Namespace: "bench",
			UID:       types.UID(fmt.Sprintf("u%d", i)),
			Labels:    map[string]string{"app": s.App},
		},
		Spec: v1.PodSpec{Containers: []v1.Container{{
			Name: "main", Resources: v1.ResourceRequirements{Limits: limits, Requests: limits},
		}}},
	}, nil
}

func run(e *extender, p plan, requests int) ([]float64, error) {
	rng := rand.New(rand.NewSource(p.Seed))
	names := append([]string(nil), p.Names...)
	timings := make([]float64, 0, requests)
	for i := 0; i < requests; i++ {
		s := p.Shapes[i%len(p.Shapes)]
		po, err := pod(i, s)
		if err != nil {
			return nil, err
		}
		rng.Shuffle(len(names), func(a, b int) { names[a], names[b] = names[b], names[a] })
		started := time.Now()
		var filtered extenderv1.ExtenderFilterResult
		err = e.send("filter", &extenderv1.ExtenderArgs{Pod: po, NodeNames: &names}, &filtered)
		if err != nil {
			return nil, err
		}
		if filtered.Error != "" {
			return nil, fmt.Errorf("filter: %s", filtered.Error)
		}
		// Always asked, as the Python client does (kube-scheduler skips it for fewer than two
		// feasible nodes, which no pod of the benchmark meets).
		var scores extenderv1.HostPriorityList
		args := &extenderv1.ExtenderArgs{Pod: po, NodeNames: filtered.NodeNames}
		if err := e.send("prioritize", args, &scores); err != nil {
			return nil, err
		}
		timings = append(timings, float64(time.Since(started).Nanoseconds())/1e6)
		if len(scores) > 0 {
			best := scores[0]
			for _, s := range scores[1:] {
				if s.Score > best.Score {
					best = s
				}
			}
			var bound extenderv1.ExtenderBindingResult
			args := &extenderv1.ExtenderBindingArgs{
				PodName: po.Name, PodNamespace: po.Namespace, PodUID: po.UID, Node: best.Host,
			}
			if err := e.send("bind", args, &bound); err != nil {
				return nil, err
			}
			if bound.Error != "" {
				return nil, fmt.Errorf("bind: %s", bound.Error)
			}
		}
	}
	return timings, nil
}

func main() {
	url := flag.String("url", "", "the extender's URL prefix, e.g. http://127.0.0.1:8888/gpupart")
	requests := flag.Int("requests", 300, "pods to schedule")
	flag.Parse()
	var p plan
	if err := json.NewDecoder(os.Stdin).Decode(&p); err != nil || *url == "" || len(p.Shapes) == 0 {
		fmt.Fprintln(os.Stderr, "usage: schedulerclient -url URL [-requests N] < PLAN.json", err)
		os.Exit(2)
	}
	e := &extender{url: *url, client: &http.Client{Timeout: 30 * time.Second}}
	timings, err := run(e, p, *requests)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(map[string][]float64{"ms": timings}); err != nil {
		os.Exit(1)
	}
}
