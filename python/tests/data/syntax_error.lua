-- Does not compile: staging it must fail at once.
return {
  name = "py_syntax_error",
  plan = function(ctx) return end end,
}
