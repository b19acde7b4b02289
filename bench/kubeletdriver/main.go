// Command kubeletdriver times device plugin RPCs from grpc-go, the client a real kubelet uses.
//
// The benchmark (bench/deviceplugin.py) runs it beside the plugin and writes one sequence per
// line on stdin; the driver answers each with one line. Requests arrive serialised by the
// benchmark, so the driver needs no generated code: it sends bytes and times the round trip.
//
//	argv:    kubeletdriver SOCKET...           (one per resource, dialled once, as kubelet does)
//	stdin:   STEP STEP ...                     STEP = SOCKET_INDEX:METHOD:HEX_REQUEST | sleep:NANOS
//	stdout:  NANOS NANOS ...                   one duration per RPC step, in order
//	         error TEXT                        when an RPC fails (the benchmark stops)
package main

import (
	"bufio"
	"context"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
)

// raw passes bytes through: the benchmark serialised the request, and only timing is wanted.
type raw struct{}

func (raw) Marshal(v interface{}) ([]byte, error) { return *(v.(*[]byte)), nil }
func (raw) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (raw) Name() string   { return "proto" }
func (raw) String() string { return "proto" }

func dial(socket string) (*grpc.ClientConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return grpc.DialContext(ctx, socket,
		grpc.WithInsecure(),
		grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
	)
}

func run(conns []*grpc.ClientConn, line string) (string, error) {
	var out []string
	for _, step := range strings.Fields(line) {
		parts := strings.SplitN(step, ":", 3)
		if parts[0] == "sleep" {
			nanos, err := strconv.ParseInt(parts[1], 10, 64)
			if err != nil {
				return "", fmt.Errorf("bad sleep %q", step)
			}
			time.Sleep(time.Duration(nanos))
			continue
		}
		if len(parts) != 3 {
			return "", fmt.Errorf("bad step %q", step)
		}
		index, err := strconv.Atoi(parts[0])
		if err != nil || index < 0 || index >= len(conns) {
			return "", fmt.Errorf("bad socket index in %q", step)
		}
		request, err := hex.DecodeString(parts[2])
		if err != nil {
			return "", fmt.Errorf("bad request in %q", step)
		}
		var response []byte
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		started := time.Now()
		err = conns[index].Invoke(ctx, "/v1beta1.DevicePlugin/"+parts[1], &request, &response,
			grpc.ForceCodec(raw{}))
		took := time.Since(started)
		cancel()
		if err != nil {
			return "", fmt.Errorf("%s: %v", parts[1], err)
		}
		out = append(out, strconv.FormatInt(took.Nanoseconds(), 10))
	}
	return strings.Join(out, " "), nil
}

func main() {
	var conns []*grpc.ClientConn
	for _, socket := range os.Args[1:] {
		conn, err := dial(socket)
		if err != nil {
			fmt.Fprintf(os.Stderr, "kubeletdriver: dial %s: %v\n", socket, err)
			os.Exit(1)
		}
		conns = append(conns, conn)
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	for in.Scan() {
		answer, err := run(conns, in.Text())
		if err != nil {
			answer = "error " + strings.ReplaceAll(err.Error(), "\n", " ")
		}
		fmt.Println(answer)
	}
}
