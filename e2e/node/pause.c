/* The pod sandbox's process: holds the pod's namespaces, reaps orphans, exits on SIGINT/SIGTERM.
 * Built statically by e2e/node/images.py into the local registry's registry.k8s.io/pause image
 * (no registry is reachable to pull the upstream one). */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void leave(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction on_stop = {.sa_handler = leave};
    struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGINT, &on_stop, NULL);
    sigaction(SIGTERM, &on_stop, NULL);
    sigaction(SIGCHLD, &on_child, NULL);
    for (;;)
        pause();
}
