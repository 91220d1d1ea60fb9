// Command nullextender is a scheduler extender that decides nothing, as cheaply as Go's standard
// library allows: filter passes every node it is sent, prioritize scores each 0, and there is no
// bind verb (kube-scheduler binds). Pointed at by a kube-scheduler profile, it shows what the
// extender protocol alone costs kube-scheduler: the floor of any extender's throughput.
//
// Usage: nullextender [-listen 127.0.0.1:0]; prints the address it listens on, then serves
// POST /filter and POST /prioritize (k8s.io/kube-scheduler/extender/v1 shapes).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
)

type args struct {
	NodeNames *[]string
}

type filterResult struct {
	NodeNames                  *[]string
	FailedNodes                map[string]string
	FailedAndUnresolvableNodes map[string]string
	Error                      string
}

type hostPriority struct {
	Host  string
	Score int64
}

func names(r *http.Request) ([]string, error) {
	var a args
	if err := json.NewDecoder(r.Body).Decode(&a); err != nil {
		return nil, err
	}
	if a.NodeNames == nil {
		return nil, fmt.Errorf("no NodeNames: nodeCacheCapable must be true")
	}
	return *a.NodeNames, nil
}

func reply(w http.ResponseWriter, body any) {
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(body); err != nil {
		fmt.Fprintln(os.Stderr, "reply:", err)
	}
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	flag.Parse()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /filter", func(w http.ResponseWriter, r *http.Request) {
		passed, err := names(r)
		if err != nil {
			reply(w, filterResult{Error: err.Error()})
			return
		}
		reply(w, filterResult{NodeNames: &passed, FailedNodes: map[string]string{},
			FailedAndUnresolvableNodes: map[string]string{}})
	})
	mux.HandleFunc("POST /prioritize", func(w http.ResponseWriter, r *http.Request) {
		hosts, err := names(r)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		scores := make([]hostPriority, len(hosts))
		for i, h := range hosts {
			scores[i] = hostPriority{Host: h}
		}
		reply(w, scores)
	})
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(ln.Addr().String())
	if err := http.Serve(ln, mux); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
