/* Relabelling a fresh placement's EP ranks so that it keeps the most experts where the
 * placement in use already has them (docs/routepack-policy.md, "Migration"). Ranks that
 * sit on the same node, with the same slot count and the same speed in every EP group,
 * are interchangeable for the placement surrogate (loads per rank, replicas' nodes), so
 * a permutation among them changes what the layer migrates, not what it scores. */
#include "joint_internal.h"

#include <string.h>

/* Ranks j and k may trade their experts. */
static bool interchangeable(const joint *jt, int32_t j, int32_t k)
{
    if (jt->node_of_rank[j] != jt->node_of_rank[k]) return false;
    if (jt->slot_begin[j + 1] - jt->slot_begin[j] != jt->slot_begin[k + 1] - jt->slot_begin[k]) return false;
    for (int32_t q = 0; q < jt->Q; q++)
        if (jt->speed[q * jt->ep + j] != jt->speed[q * jt->ep + k]) return false;
    return true;
}

size_t joint_relabel_scratch_ints(const joint *jt)
{
    return (size_t)jt->ep * jt->ep + (size_t)jt->ep + (size_t)jt->S;
}

/* kept[j * ep + k]: experts of `lay`'s rank j that `old`'s rank k holds. Local search on
 * the assignment (lay's rank j goes to perm[j]) by swapping two interchangeable targets
 * while the total kept grows: from the identity, so it never keeps fewer than `lay`
 * as it is; each accepted swap adds at least one kept expert, so it ends. */
void joint_relabel(const joint *jt, joint_layer *lay, const joint_layer *old, int32_t *scratch)
{
    const int32_t ep = jt->ep;
    if (ep < 2) return;
    int32_t *kept = scratch, *perm = kept + (size_t)ep * ep, *moved = perm + ep;
    memset(kept, 0, (size_t)ep * ep * sizeof *kept);
    for (int32_t j = 0; j < ep; j++) {
        for (int32_t s = jt->slot_begin[j]; s < jt->slot_begin[j + 1]; s++) {
            int32_t e = lay->phy2log[s];
            if (e < 0) continue;
            /* a second replica of e on rank j counts once */
            bool dup = false;
            for (int32_t t = jt->slot_begin[j]; t < s && !dup; t++) dup = lay->phy2log[t] == e;
            if (dup) continue;
            for (int32_t i = old->rep_off[e]; i < old->rep_off[e + 1]; i++) kept[(size_t)j * ep + old->rep_rank[i]]++;
        }
        perm[j] = j;
    }
    for (bool better = true; better;) {
        better = false;
        for (int32_t a = 0; a < ep; a++)
            for (int32_t b = a + 1; b < ep; b++) {
                if (!interchangeable(jt, perm[a], perm[b])) continue;
                int32_t now = kept[(size_t)a * ep + perm[a]] + kept[(size_t)b * ep + perm[b]];
                int32_t then = kept[(size_t)a * ep + perm[b]] + kept[(size_t)b * ep + perm[a]];
                if (then > now) {
                    int32_t x = perm[a];
                    perm[a] = perm[b];
                    perm[b] = x;
                    better = true;
                }
            }
    }
    bool identity = true;
    for (int32_t j = 0; j < ep; j++) identity &= perm[j] == j;
    if (identity) return;
    memcpy(moved, lay->phy2log, (size_t)jt->S * sizeof *moved);
    for (int32_t j = 0; j < ep; j++) {
        int32_t to = jt->slot_begin[perm[j]];
        memcpy(lay->phy2log + to, moved + jt->slot_begin[j],
               (size_t)(jt->slot_begin[j + 1] - jt->slot_begin[j]) * sizeof *moved);
    }
    joint_layer_index(jt, lay);
}
