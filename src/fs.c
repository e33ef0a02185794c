/* fs: placeholder until the fs family lands. */
#include "core.h"
void mb_open_fs(lua_State *L) { (void)L; }
