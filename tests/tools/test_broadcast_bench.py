"""The broadcast bench's LL-HLS reader follows a playlist: its parts, its map, its end and the next part to ask."""
import pytest

from tools.broadcast_bench import parse_playlist

pytestmark = pytest.mark.cpu

LIVE = """#EXTM3U
#EXT-X-VERSION:9
#EXT-X-TARGETDURATION:6
#EXT-X-PART-INF:PART-TARGET=1.500
#EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES,PART-HOLD-BACK=4.500
#EXT-X-MEDIA-SEQUENCE:3
#EXT-X-MAP:URI="init.mp4"
#EXTINF:4.958,
seg/3.m4s
#EXT-X-PART:DURATION=1.417,URI="part/16.m4s",INDEPENDENT=YES
#EXT-X-PART:DURATION=1.417,URI="part/17.m4s",INDEPENDENT=YES
#EXTINF:2.834,
seg/4.m4s
#EXT-X-PART:DURATION=1.417,URI="part/18.m4s",INDEPENDENT=YES
#EXT-X-PRELOAD-HINT:TYPE=PART,URI="part/19.m4s"
"""


def test_a_live_playlist_gives_its_parts_and_the_next_part_of_the_open_segment():
    playlist = parse_playlist(LIVE)
    assert playlist.parts == ["part/16.m4s", "part/17.m4s", "part/18.m4s"] and playlist.map_uri == "init.mp4"
    assert not playlist.ended and playlist.following == (5, 1)
    assert playlist.part_msn == {"part/16.m4s": 4, "part/17.m4s": 4, "part/18.m4s": 5}
    assert playlist.segments == {3: "seg/3.m4s", 4: "seg/4.m4s"}


def test_a_playlist_whose_last_segment_closed_asks_for_the_first_part_of_the_next_and_sees_the_end():
    text = LIVE.replace('#EXT-X-PART:DURATION=1.417,URI="part/18.m4s",INDEPENDENT=YES\n'
                        '#EXT-X-PRELOAD-HINT:TYPE=PART,URI="part/19.m4s"\n', "")
    assert parse_playlist(text).following == (5, 0)
    assert parse_playlist(text + "#EXT-X-ENDLIST\n").ended is True
