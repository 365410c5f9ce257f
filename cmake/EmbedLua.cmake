# Writes a Lua source file into a C header as a byte array, so the library carries the
# Lua parts of its runtime (lua/*.lua) without reading files at run time:
#   cmake -DINPUT=lua/x.lua -DOUTPUT=x.h -DNAME=rp_lua_x -P cmake/EmbedLua.cmake
# gives `static const char rp_lua_x[] = {...};` (no terminating NUL: sizeof is the length).
file(READ "${INPUT}" hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n    " bytes "${bytes}")
get_filename_component(source "${INPUT}" NAME)
file(WRITE "${OUTPUT}.tmp"
  "/* Generated from lua/${source} by cmake/EmbedLua.cmake; do not edit. */\n"
  "static const char ${NAME}[] = {\n    ${bytes}\n};\n")
# replace only when changed, so an unchanged file does not rebuild its users
configure_file("${OUTPUT}.tmp" "${OUTPUT}" COPYONLY)
file(REMOVE "${OUTPUT}.tmp")
