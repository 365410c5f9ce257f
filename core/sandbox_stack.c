/* How much C stack the calling thread has below a policy call: the sandbox sizes its C
 * stack guard from it (or refuses the call), since the guard's 256 KiB does not exist on
 * small thread stacks (musl's default is 128 KiB; a recursive gsub crashed there). */
#define _GNU_SOURCE /* pthread_getattr_np */
#include "sandbox_stack.h"

size_t sandbox_stack_room(sandbox_stack *cache, uintptr_t frame)
{
    pthread_t self = pthread_self();
    /* the same thread with the frame inside the bounds found for it: the same stack (a
     * thread id reused by a new thread with a smaller stack would also place its frame
     * near its top, so the bounds are read again whenever the id changes) */
    if (!(cache->known && pthread_equal(cache->thread, self) && frame > cache->low && frame <= cache->high)) {
        pthread_attr_t attr;
        void *addr = NULL;
        size_t size = 0;
        cache->known = false;
        if (pthread_getattr_np(self, &attr) != 0) return SIZE_MAX;
        int rc = pthread_attr_getstack(&attr, &addr, &size);
        pthread_attr_destroy(&attr);
        if (rc != 0 || !addr || size == 0) return SIZE_MAX;
        cache->known = true;
        cache->thread = self;
        cache->low = (uintptr_t)addr;
        cache->high = (uintptr_t)addr + size;
        if (!(frame > cache->low && frame <= cache->high)) {
            cache->known = false;
            return SIZE_MAX;
        }
    }
    return frame - cache->low;
}
