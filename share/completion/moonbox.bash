# bash completion for moonbox(1)
# compgen -W words here have no blanks, so word-splitting its output is the
# bash-completion idiom
# shellcheck disable=SC2207
_moonbox() {
  local cur prev words cword
  _init_completion || return
  case $prev in
    --policy)
      COMPREPLY=($(compgen -W 'strict dev' -- "$cur"))
      _filedir lua
      return ;;
    --handler) _filedir lua; return ;;
    --token-file | --access-log) _filedir; return ;;
    --prewarm) COMPREPLY=($(compgen -W 'on off' -- "$cur")); return ;;
    --listen | --max-body | --max-connections | --idle-timeout-ms | --max-sandboxes | \
      --idle-timeout-s | --shutdown-grace-s | --max-buffered-bytes | -e)
      return ;;
  esac
  local sub="" i
  for ((i = 1; i < cword; i++)); do
    case ${words[i]} in
      serve | mcp | image) sub=${words[i]}; break ;;
      --policy) ((i++)) ;;
    esac
  done
  case $sub in
    serve)
      COMPREPLY=($(compgen -W '--listen --policy --handler --token-file --no-token --max-body
        --max-connections --idle-timeout-ms --prewarm --max-sandboxes --idle-timeout-s
        --shutdown-grace-s --access-log --max-buffered-bytes --allow-unisolated --help' -- "$cur"))
      return ;;
    mcp) COMPREPLY=($(compgen -W '--policy --sandbox --help' -- "$cur")); return ;;
    image)
      if [[ ${words[cword - 1]} == image ]]; then
        COMPREPLY=($(compgen -W 'pull ls rm' -- "$cur"))
      fi
      return ;;
  esac
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W '--policy -e -i --help --version' -- "$cur"))
  else
    COMPREPLY=($(compgen -W 'serve mcp image' -- "$cur"))
    _filedir lua
  fi
}
complete -F _moonbox moonbox
