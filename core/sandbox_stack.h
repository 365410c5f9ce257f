/* The calling thread's C stack, for the sandbox's C stack guard (core/sandbox_stack.c). */
#ifndef RP_SANDBOX_STACK_H
#define RP_SANDBOX_STACK_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The bounds of the last thread asked about: pthread_getattr_np reads /proc/self/maps
 * for the main thread, so a sandbox keeps them while it is called from one thread. */
typedef struct sandbox_stack {
    bool known;
    pthread_t thread;
    uintptr_t low, high;
} sandbox_stack;

/* Bytes of the calling thread's stack below `frame` (an address in the caller's frame),
 * or SIZE_MAX when the thread's stack cannot be found. */
size_t sandbox_stack_room(sandbox_stack *cache, uintptr_t frame);

#endif
