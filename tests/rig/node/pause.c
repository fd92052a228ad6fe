/* The pod sandbox's process (the "pause" container): holds the pod's namespaces and
 * waits for a signal. Built statically by provision.sh into the rig's pause image, as
 * nothing may be pulled from a registry. */
#include <signal.h>
#include <unistd.h>

static void leave(int sig) {
  (void)sig;
  _exit(0);
}

int main(void) {
  signal(SIGINT, leave);
  signal(SIGTERM, leave);
  for (;;) pause();
}
