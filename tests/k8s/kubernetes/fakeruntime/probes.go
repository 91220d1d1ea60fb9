package main

// A pod's "network": each sandbox gets an address of its own on the loopback network
// (127.0.0.0/8 is all loopback on Linux), and every container port its pod declares is
// listened on there, answering any HTTP request with 200 and any TLS handshake with a
// self-signed certificate (the kubelet's HTTPS probes do not verify it) and then 200. So the
// kubelet's HTTP, HTTPS and TCP probes of a fake container pass, as a healthy container's
// would, and the pod becomes Ready. Nothing else listens: a pod without ports is unreachable,
// as an idle container is.

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

type network struct {
	mu        sync.Mutex
	next      uint32                    // the next loopback address to try, as a number
	listeners map[string][]net.Listener // sandbox id -> its ports' listeners
	tlsConfig *tls.Config
}

func newNetwork() (*network, error) {
	cert, err := selfSigned()
	if err != nil {
		return nil, err
	}
	return &network{
		// A random start, so the nodes of one machine (and of several test runs) rarely try
		// the same addresses; an address whose port is taken is skipped.
		next:      0x7f010000 + uint32(mrand.IntN(0xfe0000)),
		listeners: map[string][]net.Listener{},
		tlsConfig: &tls.Config{Certificates: []tls.Certificate{cert}},
	}, nil
}

// attach gives the sandbox an address where each of its pod's container ports listens.
func (n *network) attach(id string, ports []*runtimeapi.PortMapping) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for attempt := 0; attempt < 64; attempt++ {
		ip := net.IPv4(byte(n.next>>24), byte(n.next>>16), byte(n.next>>8), byte(n.next)).String()
		n.next++
		if byte(n.next) == 0 || byte(n.next) == 255 {
			n.next++
		}
		var ls []net.Listener
		ok := true
		for _, p := range ports {
			if p.GetProtocol() != runtimeapi.Protocol_TCP || p.GetContainerPort() <= 0 {
				continue
			}
			l, err := net.Listen("tcp", net.JoinHostPort(ip, fmt.Sprint(p.GetContainerPort())))
			if err != nil {
				ok = false
				break
			}
			ls = append(ls, l)
		}
		if !ok {
			for _, l := range ls {
				l.Close()
			}
			continue
		}
		for _, l := range ls {
			go n.serve(l)
		}
		n.listeners[id] = ls
		return ip, nil
	}
	return "", fmt.Errorf("no free loopback address for sandbox %s", id)
}

// detach closes the sandbox's listeners (stopped or removed).
func (n *network) detach(id string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, l := range n.listeners[id] {
		l.Close()
	}
	delete(n.listeners, id)
}

func (n *network) serve(l net.Listener) {
	for {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		go n.answer(conn)
	}
}

// answer serves one connection: TLS when it opens with a handshake record, plain HTTP else.
func (n *network) answer(conn net.Conn) {
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	peek := bufio.NewReader(conn)
	first, err := peek.Peek(1)
	if err != nil {
		return
	}
	var rw net.Conn = &peeked{Conn: conn, r: peek}
	if first[0] == 0x16 { // a TLS handshake record
		t := tls.Server(rw, n.tlsConfig)
		if err := t.Handshake(); err != nil {
			return
		}
		rw = t
	}
	r := bufio.NewReader(rw)
	for {
		req, err := http.ReadRequest(r)
		if err != nil {
			return
		}
		req.Body.Close()
		body := "ok\n"
		_, err = fmt.Fprintf(rw, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		if err != nil || req.Close {
			return
		}
	}
}

type peeked struct {
	net.Conn
	r *bufio.Reader
}

func (p *peeked) Read(b []byte) (int, error) { return p.r.Read(b) }

func selfSigned() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	template := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "fakeruntime pod"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(30 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, template, template, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

func (r *runtime) RunPodSandbox(ctx context.Context, req *runtimeapi.RunPodSandboxRequest) (*runtimeapi.RunPodSandboxResponse, error) {
	resp, err := r.RemoteRuntime.RunPodSandbox(ctx, req)
	if err != nil {
		return nil, err
	}
	id := resp.GetPodSandboxId()
	r.net.detach(id) // a sandbox made again under the same id
	ip, err := r.net.attach(id, req.GetConfig().GetPortMappings())
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakeruntime:", err)
		return resp, nil
	}
	svc := r.RuntimeService
	svc.Lock()
	defer svc.Unlock()
	if s, ok := svc.Sandboxes[id]; ok && s.Network != nil {
		s.Network.Ip = ip
		s.Network.AdditionalIps = nil
	}
	return resp, nil
}

func (r *runtime) StopPodSandbox(ctx context.Context, req *runtimeapi.StopPodSandboxRequest) (*runtimeapi.StopPodSandboxResponse, error) {
	r.net.detach(req.GetPodSandboxId())
	return r.RemoteRuntime.StopPodSandbox(ctx, req)
}

func (r *runtime) RemovePodSandbox(ctx context.Context, req *runtimeapi.RemovePodSandboxRequest) (*runtimeapi.RemovePodSandboxResponse, error) {
	r.net.detach(req.GetPodSandboxId())
	return r.RemoteRuntime.RemovePodSandbox(ctx, req)
}
