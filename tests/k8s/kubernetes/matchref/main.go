// Command matchref answers match and parse questions with Kubernetes' own code, so that gpupart's
// tests can compare gpupart's answers with Kubernetes' (tests/core/test_reference_kubernetes.py).
//
// It reads one JSON question per line on stdin and writes one JSON answer per line on stdout,
// serving any number of questions in one process. Questions (the "op" field):
//
//	selector:     {"selector": LabelSelector|null, "labels": {...}}
//	              -> {"error", "empty", "matches"}  (metav1.LabelSelectorAsSelector)
//	nodeAffinity: {"pod": Pod, "node": Node}
//	              -> {"matches"}  (nodeaffinity.GetRequiredNodeAffinity(pod).Match(node), as the
//	              NodeAffinity filter reads it: a parse error is no match)
//	podAffinity:  {"pod": Pod, "existing": Pod, "namespaces": [Namespace]}
//	              -> {"error", "filtered", "score"}: kube-scheduler's InterPodAffinity plugin run on
//	              one node "node" (label kubernetes.io/hostname=node) where `existing` runs, with
//	              these Namespaces in its lister; "filtered" is true when Filter rejects the node,
//	              "score" is the plugin's raw Score for it, "error" PreFilter's failure.
//	quantity:     {"text": "..."} -> {"error", "value"}  (resource.ParseQuantity; value exact)
//
// An answer carries "fault" instead when the question itself could not be read.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/apis/config"
	"k8s.io/kubernetes/pkg/scheduler/backend/cache"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/interpodaffinity"
	frameworkruntime "k8s.io/kubernetes/pkg/scheduler/framework/runtime"
	schedulermetrics "k8s.io/kubernetes/pkg/scheduler/metrics"
)

type question struct {
	Op         string                `json:"op"`
	Selector   *metav1.LabelSelector `json:"selector"`
	Labels     map[string]string     `json:"labels"`
	Pod        *v1.Pod               `json:"pod"`
	Node       *v1.Node              `json:"node"`
	Existing   *v1.Pod               `json:"existing"`
	Namespaces []v1.Namespace        `json:"namespaces"`
	Text       string                `json:"text"`
}

type answer map[string]any

const hostname = "kubernetes.io/hostname"

func main() {
	// The plugin's parallelizer records metrics, as in kube-scheduler itself.
	schedulermetrics.Register()
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
			a = respond(&q)
		}
		if err := encoder.Encode(a); err != nil {
			fmt.Fprintln(os.Stderr, "matchref:", err)
			os.Exit(1)
		}
		// One answer per question, at once: the caller waits for it before asking the next.
		if err := out.Flush(); err != nil {
			os.Exit(1)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "matchref:", err)
		os.Exit(1)
	}
}

func respond(q *question) answer {
	switch q.Op {
	case "selector":
		selector, err := metav1.LabelSelectorAsSelector(q.Selector)
		if err != nil {
			return answer{"error": err.Error()}
		}
		return answer{"error": "", "empty": selector.Empty(), "matches": selector.Matches(labels.Set(q.Labels))}
	case "nodeAffinity":
		if q.Pod == nil || q.Node == nil {
			return answer{"fault": "nodeAffinity needs pod and node"}
		}
		matches, _ := nodeaffinity.GetRequiredNodeAffinity(q.Pod).Match(q.Node)
		return answer{"matches": matches}
	case "podAffinity":
		if q.Pod == nil || q.Existing == nil {
			return answer{"fault": "podAffinity needs pod and existing"}
		}
		return podAffinity(q.Pod, q.Existing, q.Namespaces)
	case "quantity":
		value, err := resource.ParseQuantity(q.Text)
		if err != nil {
			return answer{"error": err.Error()}
		}
		return answer{"error": "", "value": value.AsDec().String()}
	}
	return answer{"fault": fmt.Sprintf("unknown op %q", q.Op)}
}

// podAffinity runs the InterPodAffinity plugin for `pod` against one node holding `existing`.
func podAffinity(pod, existing *v1.Pod, namespaces []v1.Namespace) answer {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node", Labels: map[string]string{hostname: "node"}}}
	placed := existing.DeepCopy()
	placed.Spec.NodeName = node.Name
	snapshot := cache.NewSnapshot([]*v1.Pod{placed}, []*v1.Node{node})

	objects := make([]runtime.Object, 0, len(namespaces))
	for i := range namespaces {
		objects = append(objects, &namespaces[i])
	}
	factory := informers.NewSharedInformerFactory(fake.NewClientset(objects...), 0)
	handle, err := frameworkruntime.NewFramework(ctx, nil, nil,
		frameworkruntime.WithSnapshotSharedLister(snapshot),
		frameworkruntime.WithInformerFactory(factory))
	if err != nil {
		return answer{"fault": err.Error()}
	}
	plugin, err := interpodaffinity.New(ctx, &config.InterPodAffinityArgs{HardPodAffinityWeight: 1}, handle, feature.Features{})
	if err != nil {
		return answer{"fault": err.Error()}
	}
	factory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())

	nodes, err := snapshot.NodeInfos().List()
	if err != nil {
		return answer{"fault": err.Error()}
	}
	state := framework.NewCycleState()
	_, status := plugin.(fwk.PreFilterPlugin).PreFilter(ctx, state, pod, nodes)
	if !status.IsSuccess() && !status.IsSkip() {
		return answer{"error": status.AsError().Error()}
	}
	filtered := false
	if !status.IsSkip() {
		filtered = !plugin.(fwk.FilterPlugin).Filter(ctx, state, pod, nodes[0]).IsSuccess()
	}
	var score int64
	scoreState := framework.NewCycleState()
	status = plugin.(fwk.PreScorePlugin).PreScore(ctx, scoreState, pod, nodes)
	if !status.IsSuccess() && !status.IsSkip() {
		return answer{"error": status.AsError().Error()}
	}
	if !status.IsSkip() {
		score, status = plugin.(fwk.ScorePlugin).Score(ctx, scoreState, pod, nodes[0])
		if !status.IsSuccess() {
			return answer{"error": status.AsError().Error()}
		}
	}
	return answer{"error": "", "filtered": filtered, "score": score}
}
