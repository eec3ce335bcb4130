// Command fake-gpu-plugin gives the e2e node nvidia.com/gpu capacity the way a GPU node gets it: it
// registers N devices with the kubelet over the device-plugin gRPC API (v1beta1), and the kubelet
// hands them to containers, exporting their indices as CUDA_VISIBLE_DEVICES and
// NVIDIA_VISIBLE_DEVICES. There is no hardware behind them: the scheduler's accounting, the
// kubelet's allocation and the pod's environment are what the e2e tier tests.
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch reports the devices once (they never change health) and holds the stream open.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, container := range req.ContainerRequests {
		ids := strings.Join(container.DevicesIds, ",")
		log.Printf("allocate %s", ids)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"CUDA_VISIBLE_DEVICES": ids, "NVIDIA_VISIBLE_DEVICES": ids}})
	}
	return resp, nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// serve listens on our socket in the kubelet's device-plugin directory and registers with the kubelet.
func serve(p *plugin, dir, socket, resource string) (*grpc.Server, error) {
	path := filepath.Join(dir, socket)
	_ = os.Remove(path)
	listener, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, filepath.Base(pluginapi.KubeletSocket)),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		server.Stop()
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: socket, ResourceName: resource})
	if err != nil {
		server.Stop()
		return nil, err
	}
	log.Printf("registered %d %s devices", len(p.devices), resource)
	return server, nil
}

func main() {
	count := flag.Int("count", 1, "how many devices to advertise")
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource name")
	dir := flag.String("dir", filepath.Dir(pluginapi.KubeletSocket), "the kubelet's device-plugin directory")
	flag.Parse()
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: strconv.Itoa(i), Health: pluginapi.Healthy})
	}
	socket := "pagedmodel-fake-gpu.sock"
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	var server *grpc.Server
	// A restarted kubelet clears its directory: our socket vanishing means register again.
	for {
		if _, err := os.Stat(filepath.Join(*dir, socket)); server == nil || err != nil {
			if server != nil {
				server.Stop()
				server = nil
			}
			s, err := serve(p, *dir, socket, *resource)
			if err != nil {
				log.Printf("not registered yet: %v", err)
			} else {
				server = s
			}
		}
		select {
		case <-stop:
			if server != nil {
				server.Stop()
			}
			_ = os.Remove(filepath.Join(*dir, socket))
			return
		case <-time.After(time.Second):
		}
	}
}
