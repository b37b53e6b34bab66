from ...instance import serve
from . import handle

serve(handle)
