from aios_blocks.instance import serve

from . import handle, init

serve(handle, init)
