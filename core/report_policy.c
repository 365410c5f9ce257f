/* What a report's policies have to show, below every page section (report_internal.h):
 * whether a policy ran a step, and the legend's widest label. */
#include "report_internal.h"

#include <string.h>

bool report_charted(const rp_report_policy *p)
{
    return p->num_steps > 0;
}

size_t report_longest_label(const rp_report *r)
{
    size_t longest = 0;
    for (int i = 0; i < r->num_policies; i++)
        if (report_charted(&r->policies[i]) && strlen(r->policies[i].label) > longest)
            longest = strlen(r->policies[i].label);
    return longest;
}
