/* Output paths of the command-line tool, checked before the work starts: a run of
 * minutes must not end in "cannot write" because a folder was missing. */
#include "cli.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The folder part of `path` ("." when it has none) into buf. */
static const char *folder_of(const char *path, char *buf, size_t size)
{
    const char *slash = strrchr(path, '/');
    if (!slash) return ".";
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    if (n >= size) n = size - 1;
    memcpy(buf, path, n);
    buf[n] = '\0';
    return buf;
}

int cli_check_output_file(const char *option, const char *path)
{
    struct stat sb;
    if (!path[0]) return cli_usage("%s: the path is empty", option);
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        return cli_usage("%s %s: is a folder; give a file name", option, path);
    char buf[4096];
    const char *dir = folder_of(path, buf, sizeof buf);
    if (stat(dir, &sb) != 0)
        return cli_usage("%s %s: the folder %s does not exist (%s); create it first", option, path,
                         dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return cli_usage("%s %s: %s is not a folder", option, path, dir);
    if (access(dir, W_OK | X_OK) != 0)
        return cli_usage("%s %s: cannot write into %s: %s", option, path, dir, strerror(errno));
    return CLI_OK;
}

int cli_make_output_dir(const char *option, const char *dir)
{
    struct stat sb;
    if (!dir[0]) return cli_usage("%s: the path is empty", option);
    if (stat(dir, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode)) return cli_usage("%s %s: exists and is not a folder", option, dir);
    } else {
        char buf[4096];
        const char *parent = folder_of(dir, buf, sizeof buf);
        if (stat(parent, &sb) != 0 || !S_ISDIR(sb.st_mode))
            return cli_usage("%s %s: the folder %s does not exist; create it first", option, dir, parent);
        if (mkdir(dir, 0777) != 0 && errno != EEXIST)
            return cli_usage("%s %s: cannot create it: %s", option, dir, strerror(errno));
    }
    if (access(dir, W_OK | X_OK) != 0) return cli_usage("%s %s: cannot write into it: %s", option, dir, strerror(errno));
    return CLI_OK;
}
